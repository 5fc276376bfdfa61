"""The one rule for free text an operator writes into the audit trail: hold reasons and
references, a release's `why`, scope and worker pause/resume and budget reasons, credential
reasons, the items change's `why`, and the console's forms for all of them.

Such text is 1 to `MAX_REASON_CHARS` characters with no control character (C0, DEL, C1:
line breaks among them), no line or paragraph separator (U+2028, U+2029) and no unpaired
surrogate, so one reason is one line in the audit trail, the logs and the console. The
API states it in its schema and refuses it with a 422 naming the field (`Reason`); the
console refuses it with a 422 page naming the field (service/http/console/web.py).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final

from pydantic import AfterValidator, Field

MAX_REASON_CHARS: Final = 1_000
MAX_REFERENCE_CHARS: Final = 200
# what the text may hold, for the schema (JSON Schema, Python and Rust read it alike)
REASON_PATTERN: Final = r"^[^\x00-\x1f\x7f-\x9f\u2028\u2029]*$"
_REFUSED: Final = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def reason_problem(text: str, max_chars: int = MAX_REASON_CHARS) -> str | None:
    """Why `text` is no acceptable reason, else None (never quoting it)."""
    if not text:
        return "must not be empty"
    if len(text) > max_chars:
        return f"must be at most {max_chars} characters"
    if _REFUSED.search(text):
        return ("must be one line of text: no control characters (line breaks included) "
                "and no unpaired surrogates")
    return None


def _checked(max_chars: int) -> AfterValidator:
    def check(text: str) -> str:
        problem = reason_problem(text, max_chars)
        if problem:
            raise ValueError(problem)
        return text

    return AfterValidator(check)


def _field(max_chars: int, description: str) -> Any:
    """The schema of such a field: the same bounds and characters, stated."""
    return Field(description=description, json_schema_extra={
        "minLength": 1, "maxLength": max_chars, "pattern": REASON_PATTERN})


Reason = Annotated[str, _field(MAX_REASON_CHARS, (
    f"one line of text for the audit trail, at most {MAX_REASON_CHARS} characters")),
    _checked(MAX_REASON_CHARS)]
Reference = Annotated[str, _field(MAX_REFERENCE_CHARS, (
    f"the external case reference: one line of at most {MAX_REFERENCE_CHARS} characters")),
    _checked(MAX_REFERENCE_CHARS)]
