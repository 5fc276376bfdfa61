"""The formats and wires Sweeper speaks with other systems, free of its domain: the HTTP/1.1
wire under the upstream client, how a connection leaves the process (proxies, TLS, private
addresses), webhook signature schemes, and JSON read strictly.

Imports nothing else of `service`.
"""
