"""The upstream deletion APIs: the client that calls one (`deletion_api`), on the wire of
`protocols.transport`.
"""
