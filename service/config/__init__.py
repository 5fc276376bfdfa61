"""What the operator wrote, checked and compiled before anything runs: process settings, the
policies file (its schema and its resolution), request templates, answer rules, list requests,
store statement text, tenant spellings and API tokens.

Imports only the bottom packages (`protocols`, `observability`, `errors`, `outcomes`) and
`evidence.signing` for the signing keys; nothing here touches the database.
"""
