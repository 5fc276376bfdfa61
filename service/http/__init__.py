"""The HTTP surface: the REST API (`api`), the operator console (`console`), the request log
(`request_log`) and the server around them (`serving`). Routers translate HTTP to domain calls
and back; no SQL here.
"""
