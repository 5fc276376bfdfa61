"""One identity per tenant: where a tenant id becomes (part of) an upstream's host name, the
id is a host name, and a host name has one canonical spelling. DNS does not tell `Acme` from
`acme` (RFC 4343), nor `acme.` from `acme`, nor `Bücher` from `xn--bcher-kva`; the ledger
does, so without one spelling a hold on one form would not cover an item registered in
another, and one object would be deleted under two operation keys.

So for a policy whose upstream's host is built from `{tenant_id}` (`Policy.tenant_in_host`)
every entry (registration, webhooks, store and list sources, holds, credentials, run and
item filters) stores and compares `host_form(tenant_id)`: one trailing dot dropped, then
lower case for ASCII, IDNA 2008 with UTS 46 mapping (lower case, NFC) to its `xn--` form
otherwise. The host check at the call (templates.checked_host) refuses a host that is not in
this form rather than lower-casing it, so an entry that forgot this step refuses the item;
it can never send it under a second identity. Other policies compare tenant ids exactly.
"""

from __future__ import annotations

import idna


def host_form(tenant_id: str) -> str:
    """The canonical spelling of a tenant id that is (part of) a host name. A value that
    cannot be a host name is returned as given: the host check refuses it with its reason."""
    name = tenant_id[:-1] if tenant_id.endswith(".") else tenant_id
    if name.isascii():
        return name.lower()
    try:
        return idna.encode(name, uts46=True).decode("ascii")
    except (idna.IDNAError, UnicodeError):
        return tenant_id
