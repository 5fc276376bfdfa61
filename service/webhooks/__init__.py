"""Storefront webhooks: a signed delivery read and checked (`deliveries`), taken in by the
process's intake (`intake`: its limit, pool and group commit) and recorded in the ledger
once per webhook id (`receipts`).
"""
