"""The formats and wires Sweeper speaks with other systems, free of its domain: the HTTP/1.1
wire under the upstream client (`transport`: the connection pool; `http1_connection`: one
connection and its answer; `http1_requests`: a request's extensions and bytes), how a
connection leaves the process (`egress`: proxies, TLS, private addresses), webhook signature
schemes (`webhook_signatures`), and JSON read strictly (`strict_json`).

Imports nothing else of `service`.
"""
