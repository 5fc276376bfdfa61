"""Per-tenant upstream credentials: stored encrypted through the API, or read from a
mounted directory, and handed to the worker per call.

- `source.py`: the `CredentialSource` protocol every source meets, and what a credential
  may be (an HTTP header value httpx sends as given);
- `crypto.py`: AES-256-GCM sealing bound to the row, the keyring (current and previous
  keys), fingerprints;
- `tenant_credentials.py`: the table's rows (the API's writes, the worker's read,
  re-encryption under the current key), sealed values only;
- `store.py`: `CredentialStore`, the cached read side for the worker;
- `directory.py`: `DirectorySource`, one file per tenant (a Kubernetes Secret volume).

    SweeperError
    └── CredentialUnreadable   a stored row no configured key opens for that row (the
                               worker treats it as no credential)
"""

from service.credentials.crypto import CredentialUnreadable, Keyring
from service.credentials.directory import DirectorySource
from service.credentials.source import CredentialSource
from service.credentials.store import CredentialStore

__all__ = ["CredentialSource", "CredentialStore", "CredentialUnreadable", "DirectorySource",
           "Keyring"]
