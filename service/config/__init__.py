"""What the operator wrote, checked and compiled before anything runs: process settings, the
policies file (its schema and its resolution), request templates, answer rules, list requests,
store statement text, tenant spellings, API tokens and the evidence signing keys.

Imports only `protocols`, `errors` and `outcomes`: nothing here touches the database.
"""
