"""Answer rules as real upstreams need them, shared by the unit and integration tests."""

from __future__ import annotations

# Shopify's customerDelete, as docs/configuration.md writes it
SHOPIFY: list[dict[str, object]] = [
    {"status": 200, "path": "errors[*].extensions.code", "equals": "THROTTLED",
     "outcome": "throttled", "reason": "throttled"},
    # a retry after a call that deleted but was not answered finds nothing: deleted
    {"status": 200, "path": "data.customerDelete.userErrors[*].message",
     "equals": "Customer can't be found", "outcome": "succeeded", "reason": "absent"},
    # UserError has `field` and `message` only: the field names what was refused
    {"status": 200, "path": "data.customerDelete.userErrors[0]", "present": True,
     "outcome": "permanent", "reason": "user_errors",
     "code": "data.customerDelete.userErrors[0].field[0]"},
    {"status": 200, "path": "data.customerDelete.deletedCustomerId", "present": True,
     "outcome": "succeeded", "reason": "deleted"},
    {"status": 200, "outcome": "transient", "reason": "no_deletion"},
]
