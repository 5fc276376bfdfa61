"""Credentials from a directory of files, one per tenant, named by the tenant id: the shape
of a Kubernetes Secret mounted as a volume (each key a file).

Kubernetes keys are `[-._a-zA-Z0-9]+`, never `.` or `..` and never starting with `..`
(the kubelet's own `..data` and `..<timestamp>` entries); a tenant id that cannot be such a
name has no credential here, so no tenant id ever names a path outside the directory. A
file that resolves (through the kubelet's symlinks) to somewhere outside the directory is
refused too.

The kubelet updates a mounted Secret by swapping the `..data` symlink to a new directory,
so a changed credential is a file with another inode. Each tenant's file is checked at
most once per `recheck_s` (one stat, no read) and read again only when its identity, size
or mtime changed: a hot tenant costs a dictionary lookup per call. The contents, less one
trailing newline, must be a credential (service/credentials/source.py) of at most 8 KiB;
a file that is not is no credential, logged (its tenant and why, never its contents) once
per change.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from service.credentials.source import MAX_SECRET_CHARS, secret_problem

log = logging.getLogger(__name__)

RECHECK_S: Final = 1.0
MAX_FILE_BYTES: Final = MAX_SECRET_CHARS + 2  # the longest credential and a CRLF
MAX_TENANTS: Final = 100_000
_FILE_NAME: Final = re.compile(r"[-._a-zA-Z0-9]{1,253}")

# what identifies a file's contents cheaply: device, inode, size, mtime in ns
_Signature = tuple[int, int, int, int]


def file_name_for(tenant_id: str) -> str | None:
    """The file that holds `tenant_id`'s credential, or None when no file may be named so."""
    if not _FILE_NAME.fullmatch(tenant_id) or tenant_id in (".", "..") \
            or tenant_id.startswith(".."):
        return None
    return tenant_id


@dataclass
class _Seen:
    value: str | None = field(repr=False)
    signature: _Signature | None
    checked_at: float


def _signature(st: os.stat_result) -> _Signature:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class DirectorySource:
    """Credentials of one upstream from files in `path` (the upstream argument of `get` is
    not consulted: each upstream has a directory of its own)."""

    def __init__(self, path: Path, *, recheck_s: float = RECHECK_S,
                 max_tenants: int = MAX_TENANTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._recheck_s = recheck_s
        self._max_tenants = max_tenants
        self._clock = clock
        self._seen: OrderedDict[str, _Seen] = OrderedDict()

    def __repr__(self) -> str:
        return f"DirectorySource({str(self.path)!r})"

    async def get(self, tenant_id: str, upstream: str) -> str | None:
        """The tenant's credential, or None (no such file, or not a usable one)."""
        return self.read(tenant_id)

    def read(self, tenant_id: str) -> str | None:
        """`get` without the event loop: at most a stat per `recheck_s`, a read per change."""
        name = file_name_for(tenant_id)
        if name is None:
            return None
        now = self._clock()
        seen = self._seen.get(name)
        if seen is not None:
            self._seen.move_to_end(name)
            if now - seen.checked_at < self._recheck_s:
                return seen.value
        try:
            signature: _Signature | None = _signature(os.stat(self.path / name))
        except OSError:
            signature = None
        if seen is not None and signature == seen.signature:
            seen.checked_at = now
            return seen.value
        value, signature = self._load(name) if signature is not None else (None, None)
        self._seen[name] = _Seen(value, signature, now)
        while len(self._seen) > self._max_tenants:
            self._seen.popitem(last=False)
        return value

    def _load(self, name: str) -> tuple[str | None, _Signature | None]:
        """The file's credential and the signature of what was read."""
        for _ in range(2):  # once more if the kubelet swapped the files mid-read
            try:
                return self._read_file(name)
            except FileNotFoundError:
                continue
            except OSError as exc:
                self._refuse(name, f"cannot be read ({exc.strerror})")
                return None, None
        return None, None

    def _read_file(self, name: str) -> tuple[str | None, _Signature | None]:
        root = os.path.realpath(self.path)
        target = os.path.realpath(self.path / name)
        if os.path.commonpath([root, target]) != root or target == root:
            self._refuse(name, "resolves to a path outside the directory")
            return None, None
        # O_NOFOLLOW: what was checked above is what is opened, not a symlink put there since
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self._refuse(name, "is not a regular file")
                return None, _signature(st)
            chunks, size = [], 0
            while size <= MAX_FILE_BYTES:
                chunk = os.read(fd, MAX_FILE_BYTES + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
        if size > MAX_FILE_BYTES:
            self._refuse(name, f"is larger than {MAX_FILE_BYTES} bytes")
            return None, _signature(st)
        return self._credential(name, b"".join(chunks)), _signature(st)

    def _credential(self, name: str, raw: bytes) -> str | None:
        if raw.endswith(b"\n"):
            raw = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
        try:
            value = raw.decode("ascii")
        except UnicodeDecodeError:
            self._refuse(name, "is not ASCII text")
            return None
        problem = secret_problem(value)
        if problem is not None:
            self._refuse(name, problem)
            return None
        return value

    def _refuse(self, name: str, why: str) -> None:
        log.warning("credential file refused", extra={
            "directory": str(self.path), "tenant_id": name, "problem": why})
