"""Storefront webhooks: a signed delivery read and checked (`deliveries`) and recorded in the
ledger (`intake`).
"""
