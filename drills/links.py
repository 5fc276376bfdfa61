"""How a network drill's processes reach PostgreSQL and the upstream: the URLs through the
drill's fault proxy or a namespace's relay, and worker processes that call the upstream under
a path prefix of their own, so that the upstream's log says which replica made each call."""

from __future__ import annotations

from sqlalchemy.engine import make_url

from drills.faultproxy import FaultProxy
from drills.netns import Namespace
from drills.stage import Proc, Stage
from drills.upstream import Call, FakeUpstream


def server(url: str) -> tuple[str, int]:
    """Where the drill's PostgreSQL listens: its host and port, or its socket directory
    (an embedded server's `?host=/dir`) and port."""
    parsed = make_url(url)
    return str(parsed.host or parsed.query.get("host") or "127.0.0.1"), int(parsed.port or 5432)


async def through(stage: Stage, proxy: FaultProxy) -> str:
    """The drill database's URL through `proxy` (started here)."""
    await proxy.start()
    return url_at(stage.db_url, "127.0.0.1", proxy.port)


def url_at(db_url: str, host: str, port: int) -> str:
    """`db_url` reached at `host`:`port` (a relay's or proxy's)."""
    url = make_url(db_url)
    query = {k: v for k, v in url.query.items() if k != "host"}  # not a socket any more
    return url.set(host=host, port=port, query=query).render_as_string(hide_password=False)


def upstream_at(upstream: FakeUpstream) -> tuple[str, int]:
    return "127.0.0.1", int(upstream.base_url.rsplit(":", 1)[1])


def by_worker(calls: list[Call]) -> dict[str, list[Call]]:
    out: dict[str, list[Call]] = {}
    for call in calls:
        out.setdefault(call.path.split("/")[1], []).append(call)
    return out


def worker(stage: Stage, name: str, env: dict[str, str], *, metrics: bool = False,
           host: Namespace | None = None, upstream_url: str | None = None) -> Proc:
    """A worker process calling the upstream under its own path prefix (`/name/...`), at
    `upstream_url` when given (a relay's) rather than the stage's; with `host`, in that
    network namespace."""
    policies = stage.workdir / f"policies-{name}.toml"
    assert stage.policies_file is not None
    assert stage.upstream_url is not None
    policies.write_text(stage.policies_file.read_text(encoding="utf-8").replace(
        stage.upstream_url, f"{upstream_url or stage.upstream_url}/{name}"), encoding="utf-8")
    return stage.start_worker(workers=8, env={"SWEEPER_POLICIES_FILE": str(policies), **env},
                              metrics=metrics, host=host)
