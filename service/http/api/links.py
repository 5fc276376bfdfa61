"""OpenAPI links: which values of one answer name the resources of another operation.

Clients read them as "what to call next"; the contract test's stateful phase follows them
to chain real calls (a run it created, then that run's status and evidence; an item a list
showed, then a re-drive of it). FastAPI has no way to declare links on a route, so they are
added to the generated document here, once, by operation id and status. A link naming an
operation, status or parameter the document does not have fails at render time, so the
checked-in contract cannot drift from them.
"""

from __future__ import annotations

import copy
from typing import Any, Final

RUN_ID: Final = "$response.body#/id"
FIRST_RUN_ID: Final = "$response.body#/runs/0/id"
FIRST_ITEM_ID: Final = "$response.body#/items/0/id"
FIRST_SCOPE: Final = "$response.body#/scopes/0/name"
SCOPE_NAME: Final = "$response.body#/name"

Link = dict[str, Any]


def _to(operation_id: str, description: str, *, parameters: dict[str, str] | None = None,
        request_body: Any = None) -> Link:
    link: Link = {"operationId": operation_id, "description": description}
    if parameters:
        link["parameters"] = parameters
    if request_body is not None:
        link["requestBody"] = request_body
    return link


def _run_links(run_id: str) -> dict[str, Link]:
    return {
        "GetRun": _to("getRun", "the run's status and progress",
                      parameters={"path.run_id": run_id}),
        "GetRunEvidence": _to("getRunEvidence", "the run's deletion evidence",
                              parameters={"path.run_id": run_id}),
    }


def _scope_links(scope: str) -> dict[str, Link]:
    return {
        "SetScopeBudget": _to("setScopeBudget", "change this scope's budget",
                              parameters={"path.scope": scope}),
        "PauseScope": _to("pauseScope", "pause this scope", parameters={"path.scope": scope}),
        "ResumeScope": _to("resumeScope", "resume this scope", parameters={"path.scope": scope}),
    }


def _change_links(ids: Any, subject: str) -> dict[str, Link]:
    return {
        "RedriveItems": _to("redriveItems", f"re-drive {subject}", request_body={
            "ids": ids, "why": f"re-drive {subject}"}),
        "CancelItems": _to("cancelItems", f"cancel {subject}", request_body={
            "ids": ids, "why": f"cancel {subject}"}),
    }


# (operation id, status) -> the links of that answer
LINKS: Final[dict[tuple[str, str], dict[str, Link]]] = {
    ("createRun", "202"): _run_links(RUN_ID),
    ("createRun", "200"): _run_links(RUN_ID),
    ("listRuns", "200"): _run_links(FIRST_RUN_ID),
    ("registerItems", "200"): {
        "ListItems": _to("listItems", "the registered items of the first entry's tenant and "
                                      "policy", parameters={
                             "query.tenant_id": "$request.body#/items/0/tenant_id",
                             "query.policy": "$request.body#/items/0/policy"}),
    },
    ("listItems", "200"): _change_links([FIRST_ITEM_ID], "the first item listed"),
    ("receiveWebhook", "202"): _change_links("$response.body#/item_ids",
                                             "the items the delivery made due"),
    ("listScopes", "200"): _scope_links(FIRST_SCOPE),
    ("setScopeBudget", "200"): _scope_links(SCOPE_NAME),
    ("pauseScope", "200"): _scope_links(SCOPE_NAME),
    ("resumeScope", "200"): _scope_links(SCOPE_NAME),
    ("placeHold", "201"): {
        "GetHold": _to("getHold", "the hold placed, with the items it holds",
                       parameters={"path.hold_id": "$response.body#/id"}),
        "ReleaseHold": _to("releaseHold", "release the hold placed",
                           parameters={"path.hold_id": "$response.body#/id"},
                           request_body={"why": "released by the contract's example"}),
    },
    ("pauseWorkers", "200"): {
        "ResumeWorkers": _to("resumeWorkers", "claim again everywhere"),
    },
}


def add_links(document: dict[str, Any]) -> None:
    """Add `LINKS` to the document's responses; KeyError naming the first link whose
    operation, status or target parameter the document does not have."""
    operations: dict[str, dict[str, Any]] = {
        op["operationId"]: op
        for item in document["paths"].values() for op in item.values()
        if isinstance(op, dict) and "operationId" in op
    }
    for (operation_id, status), links in LINKS.items():
        source = operations.get(operation_id)
        if source is None or status not in source.get("responses", {}):
            raise KeyError(f"links: no answer {status} of operation {operation_id!r}")
        for name, link in links.items():
            target = operations.get(link["operationId"])
            if target is None:
                raise KeyError(f"links: {operation_id} {status} {name}: no operation "
                               f"{link['operationId']!r}")
            declared = {f"{p['in']}.{p['name']}" for p in target.get("parameters", [])}
            missing = set(link.get("parameters", {})) - declared
            if missing:
                raise KeyError(f"links: {operation_id} {status} {name}: "
                               f"{link['operationId']} has no parameter {sorted(missing)}")
        source["responses"][status]["links"] = copy.deepcopy(links)
