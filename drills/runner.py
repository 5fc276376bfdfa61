"""Running one drill: `run_drill` gives it a scratch database's stage (drills/stage.py),
and turns the outcome into a one-line verdict."""

from __future__ import annotations

import shutil
import tempfile
import time
import traceback
import uuid
from pathlib import Path

from drills.base import Drill, DrillFailed, DrillSkipped, Facts, Verdict
from drills.stage import Stage


def drill_label() -> str:
    """A unique prefix for one drill's tenants, so its rows are recognisable."""
    return f"drill-{uuid.uuid4().hex[:8]}"


async def run_drill(drill: Drill, db_url: str, *, keep_logs: Path | None = None) -> Verdict:
    """Run one drill against a migrated database (plain postgresql:// URL); every process it
    started is stopped before this returns."""
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="sweeper-drill-", dir=keep_logs))
    stage = Stage(db_url, workdir, label=drill_label())
    facts: Facts = {}
    try:
        facts = await drill.run(stage)
        status, reason = "pass", None
    except DrillSkipped as exc:
        status, reason = "skip", str(exc)
    except DrillFailed as exc:
        status, reason = "fail", str(exc)
    except Exception as exc:
        status = "fail"
        reason = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
    finally:
        await stage.aclose()
    if status == "fail":
        facts = {**stage.facts, **facts}
        reason = f"{reason}\n{stage.log_tail()}\n(logs in {workdir})"
    elif keep_logs is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return Verdict(drill, status, time.monotonic() - started, facts or stage.facts, reason)
