"""The lines of an evidence export (`application/x-ndjson`: service/evidence/export_slices.py
writes them), as schemas in the OpenAPI document: each export response's `x-itemSchema` is
`EvidenceLine`, one of the five kinds below, which every line matches.

`x-itemSchema` is OpenAPI 3.2's `itemSchema` (the schema of each item of a sequential media
type), spelled as an extension while FastAPI writes OpenAPI 3.1 documents; the response's own
`schema` is a string, the body as text. A test validates every line of real exports against
these schemas.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

HEX_256: Final = r"^[0-9a-f]{64}$"


class _Line(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CheckpointStatement(_Line):
    format: str
    size: int = Field(ge=0, description="entries in the log up to this checkpoint")
    head: str = Field(pattern=HEX_256, description="the chain hash after entry `size`")
    signed_at: datetime
    key_id: str | None = Field(description="null: the genesis checkpoint, or no signing key")


class CheckpointLine(_Line):
    """A signed checkpoint: opens a slice, and follows each segment whose end it signs."""

    checkpoint: CheckpointStatement
    signature: str | None = Field(description=(
        "Ed25519 over the statement's canonical JSON (keys sorted, no spaces), base64; null "
        "for the genesis checkpoint or without a signing key"))


class EntryLine(_Line):
    """An entry: one deletion's record in full."""

    seq: int = Field(ge=1, description="its place in the evidence log")
    item_id: int
    run_id: int | None
    released_by: Literal["run", "webhook"]
    tenant_id: str
    object_id: str
    policy: str
    policy_version: int
    operation_key: str
    outcome: str
    upstream_status: int | None
    attempts: int
    completed_at: datetime
    confirmed: bool | None = Field(default=None, description=(
        "a confirmation read found the object gone (records written since format 2; absent "
        "in older ones)"))
    region: str | None = Field(default=None, description=(
        "the region of the worker that completed the deletion, null for a worker of no "
        "region (records written since format 3; absent in older ones)"))


class LeafLine(_Line):
    """In a run's export, another run's entry: its leaf digest only (no other tenant's
    identifiers), which the chain still needs."""

    seq: int = Field(ge=1)
    leaf: str = Field(pattern=HEX_256)


class UnreadableLine(_Line):
    """A stored record that is no record: its bytes as stored (hex), for the verifier to
    refuse."""

    seq: int = Field(ge=1)
    unreadable: str = Field(pattern=r"^(?:[0-9a-f]{2})*$")


class SegmentRange(_Line):
    first: int = Field(ge=1)
    last: int = Field(ge=1)
    hash: str = Field(pattern=HEX_256, description="the chain hash after entry `last`")


class SegmentLine(_Line):
    """Closes one completion's entries: their range and the chain hash after them."""

    segment: SegmentRange


class Manifest(_Line):
    format: str
    run_id: int | None = Field(description="the run exported; null: a range of the log")
    after: int | None = Field(description="the range's `after`; null: a run's export")
    records: int = Field(ge=0, description="entry lines with a full record")
    entries: int = Field(ge=0, description="entry lines in all")
    digest: str = Field(pattern=HEX_256, description="SHA-256 of every line before this one")
    next_after: int | None = Field(description="the next page's `after`; null: no more")
    exported_at: datetime
    key_id: str | None


class ManifestLine(_Line):
    """The last line: what the export holds, signed as a checkpoint is."""

    manifest: Manifest
    signature: str | None


EvidenceLine = CheckpointLine | EntryLine | LeafLine | UnreadableLine | SegmentLine | \
    ManifestLine
LINE_SCHEMA_NAME: Final = "EvidenceLine"
_LINES: Final = TypeAdapter(EvidenceLine)


def add_line_schemas(document: dict[str, Any]) -> None:
    """Declare the line schemas in `document`'s components and on every NDJSON response."""
    schema = _LINES.json_schema(ref_template="#/components/schemas/{model}")
    components = document.setdefault("components", {}).setdefault("schemas", {})
    components.update(schema.pop("$defs"))
    components[LINE_SCHEMA_NAME] = {**schema, "title": LINE_SCHEMA_NAME, "description": (
        "one line of an evidence export (application/x-ndjson)")}
    for item in document["paths"].values():
        for operation in item.values():
            if not isinstance(operation, dict):
                continue
            for response in operation.get("responses", {}).values():
                media = response.get("content", {}).get("application/x-ndjson")
                if media is not None:
                    media["schema"] = {"type": "string", "description": (
                        "JSON lines, each an EvidenceLine (x-itemSchema)")}
                    media["x-itemSchema"] = {"$ref": f"#/components/schemas/{LINE_SCHEMA_NAME}"}
