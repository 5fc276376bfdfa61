"""One Celery worker draining a queue of no-op tasks, for `bench peers` (bench/celery_peer.py).

    python -m bench.celery_worker BROKER_URL QUEUE POOL CONCURRENCY PREFETCH TARGET

Runs a Celery worker on QUEUE with late acks and the given pool, concurrency and prefetch
multiplier. The clock starts when the worker is ready (the queue is full by then) and stops
when TARGET tasks have finished; every task's finish is counted in a counter in shared
memory, so a prefork pool's child processes count too. Prints one JSON line (elapsed
seconds, tasks finished, this process tree's CPU seconds over the window), then shuts down
warm: messages it prefetched and did not run go back to the queue.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from celery import Celery, signals  # type: ignore[import-untyped]

from bench.common import cpu_seconds

DONE = multiprocessing.Value("q", 0, lock=True)  # created before the pool forks


def tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and its children alive now (a prefork pool's), from /proc."""
    tree = [pid]
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError):
            if entry.name.isdigit() and int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                tree.append(int(entry.name))
    total = 0.0
    for member in tree:
        with contextlib.suppress(OSError):  # a child that exited meanwhile
            total += cpu_seconds(member)
    return total


def make_app(broker: str, queue: str, prefetch: int) -> Celery:
    app = Celery("sweeper_bench_peer", broker=broker)
    app.conf.update(task_acks_late=True, worker_prefetch_multiplier=prefetch,
                    task_ignore_result=True, task_default_queue=queue,
                    broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
                    worker_send_task_events=False, task_send_sent_event=False,
                    worker_redirect_stdouts=False)

    @app.task(name="noop")  # type: ignore[untyped-decorator]
    def noop() -> None:
        return None

    return app


def main(argv: list[str]) -> None:
    broker, queue, pool, concurrency, prefetch, target = argv
    app = make_app(broker, queue, int(prefetch))
    started: dict[str, float] = {}
    me = os.getpid()

    @signals.task_postrun.connect  # type: ignore[untyped-decorator]
    def finished(**_: Any) -> None:
        with DONE.get_lock():
            DONE.value += 1

    @signals.worker_ready.connect  # type: ignore[untyped-decorator]
    def ready(**_: Any) -> None:
        started["t"], started["cpu"] = time.perf_counter(), tree_cpu(me)
        threading.Thread(target=watch, daemon=True).start()

    def watch() -> None:
        while DONE.value < int(target):
            time.sleep(0.005)
        elapsed = time.perf_counter() - started["t"]
        cpu = tree_cpu(me) - started["cpu"]
        print(json.dumps({"seconds": elapsed, "finished": DONE.value, "cpu_seconds": cpu}),
              flush=True)
        os.kill(me, signal.SIGTERM)

    app.worker_main(["worker", "--loglevel", "WARNING", "--pool", pool,
                     "--concurrency", concurrency, "--queues", queue, "--without-gossip",
                     "--without-mingle", "--without-heartbeat"])


if __name__ == "__main__":
    main(sys.argv[1:])
