"""The policies file read entry by entry, before any entry is resolved: each entry validated
against the schema on its own (one entry's mistakes never hide another's), its name checked,
and the upstreams, stores and policies entries name one another by, read from the entries as
written (an entry that does not fit the schema is still declared, and still has its names
checked).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from pydantic import ValidationError

from service.config.policy_file import NAME_PATTERN, SOURCE_KINDS, PoliciesFile
from service.config.resolution import Resolution

# The file's sections of named entries, in the order they are resolved.
SECTIONS: Final = ("upstreams", "stores", "policies", "webhooks")

# Each section's entries as written, by name; a section the file leaves out is empty.
Written = Mapping[str, Mapping[str, Any]]


def validate_entries(raw: Mapping[str, Any], r: Resolution) -> tuple[PoliciesFile, Written]:
    """The entries that fit the schema, each validated on its own, and every entry as
    written, by section; schema problems are noted in `r`, in the file's order."""
    valid: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    written: dict[str, Mapping[str, Any]] = {section: {} for section in SECTIONS}
    for section, value in raw.items():
        parts = [value]
        if section in SECTIONS and isinstance(value, Mapping):
            written[section] = value
            parts = [{name: entry} for name, entry in value.items()]
        for part in parts:
            try:
                one = PoliciesFile.model_validate({section: part})
            except ValidationError as exc:
                for key, message in schema_problems(exc):
                    r.fail(key, message)
            else:
                # a section of named entries, or one checked whole (`regions`)
                valid.setdefault(section, {}).update(getattr(one, section))
    # validated already: the models are taken as they are
    return PoliciesFile.model_validate(valid), written


def schema_problems(exc: ValidationError) -> list[tuple[str, str]]:
    """Each schema error as (key, message), the key in the file's own notation."""
    problems = []
    for err in exc.errors(include_input=False, include_url=False):
        loc = [p for i, p in enumerate(err["loc"])
               if not (i and err["loc"][i - 1] == "source" and p in SOURCE_KINDS)]
        key = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in loc)
        key = key.replace(".[", "[")
        message = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key (check the spelling; see docs/configuration.md)"
        elif err["type"] == "missing":
            message = "required key is missing"
        problems.append((key, message))
    return problems


def name_problems(written: Written, r: Resolution) -> None:
    """Every entry's name, checked against the pattern names follow; problems go to `r`."""
    for section, entries in written.items():
        for name in entries:
            if not re.match(NAME_PATTERN, name):
                r.fail(f"{section}.{name}", "names are lower-case letters, digits, '-', '_' "
                                            "or '.', at most 63 characters")


def names_given(entry: object) -> list[tuple[str, str, str]]:
    """The upstreams and stores a policy entry names, as written: (its key, the section,
    the name) each."""
    if not isinstance(entry, Mapping):
        return []
    named = [("upstream", "upstreams", entry.get("upstream"))]
    for part in ("source", "target", "guard"):
        cfg = entry.get(part)
        if isinstance(cfg, Mapping):
            # a source with an upstream is that upstream's list (policy_file._source_kind)
            named.append((f"{part}.upstream", "upstreams", cfg["upstream"])
                         if part == "source" and "upstream" in cfg
                         else (f"{part}.store", "stores", cfg.get("store")))
    return [(sub, section, name) for sub, section, name in named if isinstance(name, str)]


def reference_problems(name: str, written: Written, r: Resolution) -> None:
    """The upstreams and stores policy `name` names that the file does not declare, read
    from the entry as written: a policy with other mistakes still has its names checked."""
    key = f"policies.{name}"
    for sub, section, named in names_given(written["policies"][name]):
        if named not in written[section]:
            r.fail(f"{key}.{sub}", f"unknown {section[:-1]} {named!r}; declared: "
                                   f"{sorted(written[section]) or 'none'}")


def rule_problems(name: str, written: Written, r: Resolution) -> None:
    """The policies webhook source `name`'s rules name that the file does not declare."""
    entry = written["webhooks"][name]
    rules = entry.get("rules") if isinstance(entry, Mapping) else None
    for i, rule in enumerate(rules if isinstance(rules, list) else []):
        policy = rule.get("policy") if isinstance(rule, Mapping) else None
        if isinstance(policy, str) and policy not in written["policies"]:
            r.fail(f"webhooks.{name}.rules[{i}].policy", f"unknown policy {policy!r}")
