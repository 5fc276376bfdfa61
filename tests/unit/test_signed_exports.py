"""service.evidence.signed_exports.verify: an export made before the evidence log
(sweeper-evidence/1) verifies as signed, and each way its lines or manifest can differ from
what was signed fails on the line that shows it, with its reason."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from service.config.signing_keys import Signer, signed_bytes
from service.evidence.signed_exports import FORMAT, VerificationFailed, digest, genesis, verify

SIGNER = Signer(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
KEYS = [SIGNER.current]


def records(run_id: int, n: int) -> tuple[list[bytes], str]:
    """`n` record lines of `run_id`, chained by `prev`, and the last one's digest."""
    prev, lines = genesis(run_id), []
    for i in range(n):
        line = json.dumps({"item_id": i + 1, "run_id": run_id, "prev": prev}).encode()
        lines.append(line)
        prev = digest(line)
    return lines, prev


def export(lines: list[bytes], **manifest: Any) -> list[bytes]:
    """The lines closed by a manifest signed over `manifest`."""
    signature = SIGNER.sign(signed_bytes(manifest))
    return [*lines, json.dumps({"manifest": manifest, "signature": signature}).encode()]


def signed(n: int = 3, **changed: Any) -> list[bytes]:
    """An export of `n` records of run 7, its manifest's fields `changed` before signing."""
    lines, last = records(7, n)
    manifest = {"format": FORMAT, "run_id": 7, "records": n, "last": last,
                "exported_at": "2026-12-01T00:00:00+00:00", "key_id": SIGNER.current.key_id}
    return export(lines, **{**manifest, **changed})


def test_a_signed_export_verifies() -> None:
    verified = verify(signed(), KEYS)
    assert (verified.run_id, verified.records) == (7, 3)


def test_an_export_without_records_verifies_by_its_manifest() -> None:
    assert verify(signed(n=0), KEYS).records == 0


def swapped(lines: list[bytes]) -> list[bytes]:
    return [lines[1], lines[0], *lines[2:]]


def other_run(lines: list[bytes]) -> list[bytes]:
    return [lines[0], records(8, 2)[0][1], *lines[2:]]


def no_run(lines: list[bytes]) -> list[bytes]:
    return [json.dumps({"prev": genesis(7)}).encode(), *lines[1:]]


CASES: list[tuple[str, Callable[[], list[bytes]], int, str]] = [
    ("a line moved", lambda: swapped(signed()), 1, "is not the first record"),
    ("a line dropped", lambda: [signed()[0], *signed()[2:]], 2, "does not follow"),
    ("another run's line", lambda: other_run(signed()), 2, "a record of run 8 in run 7"),
    ("a record without its run", lambda: no_run(signed()), 1, "a record without its run_id"),
    ("another format", lambda: signed(format="x/1"), 4, "format is not"),
    ("another run's manifest", lambda: signed(run_id=9), 4, "another run"),
    ("a wrong count", lambda: signed(records=2), 4, "counts 2 records, the export holds 3"),
    ("a wrong last digest", lambda: signed(last="00"), 4, "last digest"),
    ("an empty export without its run", lambda: signed(n=0, run_id="7"), 1, "without its run"),
    ("no manifest", lambda: signed()[:-1], 4, "ends without its manifest"),
    ("unsigned", lambda: signed(key_id=None), 4, "is not signed"),
]


@pytest.mark.parametrize(("changed", "line", "reason"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_each_difference_fails_on_its_line(changed: Callable[[], list[bytes]], line: int,
                                           reason: str) -> None:
    with pytest.raises(VerificationFailed) as failed:
        verify(changed(), KEYS)
    assert failed.value.line == line and reason in failed.value.reason, failed.value
