"""The upstream deletion APIs: the client that calls one (`deletion_api`), each call one
exchange (`exchange`: deadline, answer read, errors mapped to failures) to a URL made under
the upstream's base (`request_urls`), on the wire of `protocols.transport`.
"""
