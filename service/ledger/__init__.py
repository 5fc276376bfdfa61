"""The obligations Sweeper owes and their state: registration and identity (`registration`),
operators' selections of items (`item_selection`) and what else they read
(`operator_reads`), leases (`claims`: the admission and the hand-back) and their fenced
completion (`completions`), legal holds (`holds`; their items marked by `hold_marking`, the
workers' acknowledgments in `hold_acks`), the ledger-wide gauges of /metrics (`gauges`),
rows in old tenant spellings (`tenant_spellings`) and items kept in their tenants' regions
(`region_pins`).
"""
