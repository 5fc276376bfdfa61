"""The obligations Sweeper owes and their state: registration (`registration`), leases and fenced
completion (`claims`), legal holds (`holds`), the operator audit trail (`audit`), what
operators read (`operator_reads`), rows in old tenant spellings (`tenant_spellings`) and
Sweeper's pruning of its own history (`retention`).
"""
