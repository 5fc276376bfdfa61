"""`sweeper evidence verify`: an evidence export checked offline, with no database: the
log's slices against their signed checkpoints (and the checkpoints kept outside the
database, if given) and the manifest, or an export made before the evidence log
(sweeper-evidence/1)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from service.commands.exits import Exit
from service.config import signing_keys
from service.errors import ConfigError

if TYPE_CHECKING:
    from service.evidence.verification import Verified


def cmd_verify_evidence(args: argparse.Namespace) -> int:
    """Verify an evidence export offline: the log's slices against their signed checkpoints
    (and the checkpoints kept outside the database, if given) and the manifest, or an
    export made before the evidence log (sweeper-evidence/1). Exit 0 verified, 1 not (the
    first failing line named), 2 a file that cannot be read."""
    from service.evidence.signed_exports import VerificationFailed

    keys = _public_keys(args.public_key)
    try:
        kept = _kept_checkpoints(args.checkpoints, keys)
    except VerificationFailed as exc:
        print(f"{args.checkpoints}: NOT verified: checkpoint {exc.line}: {exc.reason}",
              file=sys.stderr)
        return Exit.INCOMPLETE
    try:
        said = _verified_export(args.file, keys, kept)
    except VerificationFailed as exc:
        print(f"{args.file}: NOT verified: {exc}", file=sys.stderr)
        return Exit.INCOMPLETE
    print(f"{args.file}: verified: {said}")
    return Exit.OK


def _public_keys(paths: list[Path]) -> list[signing_keys.PublicKey]:
    """Every public key of the --public-key files; ConfigError names a file that cannot be
    read or holds no key."""
    keys: list[signing_keys.PublicKey] = []
    for path in paths:
        try:
            keys.extend(signing_keys.public_keys(path.read_bytes()))
        except OSError as exc:
            raise ConfigError(f"--public-key {path}: cannot be read ({exc.strerror})") from None
        except signing_keys.KeyProblem as exc:
            raise ConfigError(f"--public-key {path}: {exc}") from None
    return keys


def _kept_checkpoints(path: Path | None, keys: list[signing_keys.PublicKey]
                      ) -> dict[int, bytes]:
    """The checkpoints kept outside the database (--checkpoints), each verified under
    `keys`, by sequence number; none when not given."""
    from service.evidence import verification

    if path is None:
        return {}
    try:
        return verification.kept_checkpoints(path.read_bytes(), keys)
    except OSError as exc:
        raise ConfigError(f"--checkpoints {path}: cannot be read ({exc.strerror})") from None


def _verified_export(file: Path, keys: list[signing_keys.PublicKey],
                     kept: dict[int, bytes]) -> str:
    """What the export holds, once verified, in one line; VerificationFailed at its first
    failing line."""
    from service.evidence import signed_exports, verification

    try:
        with file.open("rb") as lines:
            first = lines.readline()
            lines.seek(0)
            if first.startswith(b'{"checkpoint"') or b'"sweeper-evidence/2"' in first:
                return _verified_slices(verification.verify(lines, keys, kept), len(kept))
            if kept:
                raise ConfigError(f"{file}: a sweeper-evidence/1 export (made before "
                                  f"the evidence log): --checkpoints does not apply")
            old = signed_exports.verify(lines, keys)
            return (f"run {old.run_id}, {old.records} record(s), signed with key "
                    f"{old.key_id} (sweeper-evidence/1: chained at export)")
    except OSError as exc:
        raise ConfigError(f"{file}: cannot be read ({exc.strerror})") from None


def _verified_slices(verified: Verified, kept: int) -> str:
    """What a verified log export holds, in one line."""
    parts = [f"run {verified.run_id}" if verified.run_id is not None else "log range",
             f"{verified.records} record(s)",
             f"entries {verified.first_seq}..{verified.last_seq}" if verified.entries
             else "no entries",
             f"{verified.checkpoints} checkpoint(s)"]
    if kept:
        parts.append(f"{kept} kept checkpoint(s) given")
    said = ", ".join(parts) + f", signed with key {verified.key_id}"
    if verified.next_after is not None:
        said += f"; next page after={verified.next_after}"
    return said
