"""What the operator wrote, checked and compiled before anything runs: process settings, the
policies file (its schema and its resolution), request templates, answer rules, list requests,
store statement text, tenant spellings, API tokens and the evidence signing keys.

- process: `settings` (SWEEPER_*; the execution fields in `execution`), `tokens` (API
  tokens and roles), `signing_keys`;
- the policies file as written: `policy_file` (its tables and keys), `policy_tables` (a
  policy's cost, backoff, batch and confirm tables), `file_entries` (each entry validated on
  its own, and the names entries give one another);
- the policies file resolved: `policies` (load and resolve; `Policies`), one module per
  section (`upstreams`, `stores`, `retention_policies`, `webhook_sources`) and what they
  share (`resolution`: the environment and the problems found);
- a policy's calls: `placeholders` (template fields, `segment`), `hosts` and `origins` (the
  host an item's ids may make), `body_templates` (JSON bodies), `request_templates` (the
  deletion call), `list_sources` (the list call), `answer_rules` (how an answer is read);
- `store_statements` (a store's SQL, from its text alone), `tenants` (a tenant id's one
  spelling as a host), `regions` (the tenants pinned to each region).

Imports only `protocols`, `errors` and `outcomes`: nothing here touches the database.
"""
