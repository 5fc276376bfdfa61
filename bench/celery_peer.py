"""Celery on the same machine's RabbitMQ, as a peer in `bench peers`: the task queue a Python
user would pick for cleanup work if not a PostgreSQL queue.

Per drain: a queue of its own (`sweeper_bench_celery_<random>`, durable, as Celery declares
it), N no-op tasks published to it before the clock starts (persistent messages, Celery's
default), then one Celery worker process (bench/celery_worker.py) with late acks
(`task_acks_late`: a task is acked after it ran, as Sweeper acks an item only once its
outcome is committed), no result backend, and the configuration's pool, concurrency and
prefetch multiplier. The clock runs from the worker's `worker_ready` to the N-th task's
end; the worker then shuts down warm (its prefetched, unrun messages go back), and the
queue must be empty: N tasks ran, none twice. CPU per task is the worker's process tree
(its pool's children included) and the broker's (RabbitMQ's beam.smp on this machine, from
/proc; none when the broker is elsewhere).

Configurations are POOL:CONCURRENCY:PREFETCH (`--celery`): `prefork:2:1` is Celery's own
default pool and concurrency on two cores with prefetch 1 and late acks, as Celery's docs
advise for long tasks; `solo:1:100` and `threads:8:100` are its fastest here for no-op
tasks. (`solo:1:1` waits about 8 ms per task for the next delivery: 118 tasks/s.)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
import uuid
from typing import Any

from kombu import Connection  # type: ignore[import-untyped]

from bench.celery_worker import make_app
from bench.common import broker_pid, cpu_seconds, progress

DEFAULT_CELERY = "prefork:2:1,solo:1:100,threads:8:100"
DEFAULT_BROKER = "amqp://guest:guest@127.0.0.1:5672//"
POOLS = ("prefork", "solo", "threads")


@dataclasses.dataclass(frozen=True)
class CeleryConfig:
    pool: str
    concurrency: int
    prefetch: int

    @property
    def label(self) -> str:
        return f"{self.pool}:{self.concurrency}:{self.prefetch}"


def celery_configs(value: str) -> list[CeleryConfig]:
    """The argparse type of --celery: POOL:CONCURRENCY:PREFETCH, comma-separated."""
    configs = []
    for spec in (v.strip() for v in value.split(",") if v.strip()):
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] not in POOLS or not all(
                p.isdigit() and int(p) >= 1 for p in parts[1:]):
            raise argparse.ArgumentTypeError(
                f"{spec!r}: expected POOL:CONCURRENCY:PREFETCH, POOL one of "
                f"{', '.join(POOLS)}, like prefork:2:1")
        configs.append(CeleryConfig(parts[0], int(parts[1]), int(parts[2])))
    if not configs:
        raise argparse.ArgumentTypeError(f"{value!r}: no configuration")
    return configs


def _ready_messages(broker: str, queue: str) -> int:
    with Connection(broker) as conn:
        return int(conn.default_channel.queue_declare(queue, passive=True).message_count)


def _enqueue(broker: str, queue: str, n: int, timeout_s: float = 60.0) -> int:
    """Publish `n` no-op tasks and wait until the queue holds them all (Celery publishes
    without confirms: the last may still be on their way); what it holds."""
    app = make_app(broker, queue, 1)
    with app.producer_or_acquire() as producer:
        for _ in range(n):
            app.send_task("noop", queue=queue, producer=producer)
    deadline = time.monotonic() + timeout_s
    while (held := _ready_messages(broker, queue)) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return held


def _delete(broker: str, queue: str) -> None:
    with Connection(broker) as conn:
        conn.default_channel.queue_delete(queue)


async def celery_repetition(broker: str, config: CeleryConfig, items: int, deadline_s: float,
                            label: str) -> dict[str, Any]:
    """Fill a fresh queue with `items` no-op tasks, drain it with one worker, verify."""
    queue = f"sweeper_bench_celery_{uuid.uuid4().hex[:8]}"
    started = time.perf_counter()
    try:
        queued = await asyncio.to_thread(_enqueue, broker, queue, items)
        enqueued = time.perf_counter()
        beam = broker_pid(broker)
        beam_before = cpu_seconds(beam) if beam else None
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.celery_worker", broker, queue, config.pool,
            str(config.concurrency), str(config.prefetch), str(items),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            env={**os.environ, "PYTHONWARNINGS": "ignore"})
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), deadline_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"celery {config.label}: not drained in {deadline_s:.0f}s"
                               ) from None
        beam_cpu = cpu_seconds(beam) - beam_before if beam and beam_before is not None \
            else None
        lines = [line for line in out.decode().splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"celery {config.label}: worker exited {proc.returncode} "
                               f"without a result")
        result = json.loads(lines[-1])
        left = await asyncio.to_thread(_ready_messages, broker, queue)
    finally:
        await asyncio.to_thread(_delete, broker, queue)
    seconds = result["seconds"]
    ok = queued == items and result["finished"] == items and left == 0
    doc = {"config": config.label, "pool": config.pool, "concurrency": config.concurrency,
           "prefetch_multiplier": config.prefetch, "items": items, "seconds": seconds,
           "jobs_per_s": round(items / seconds, 1),
           "cpu_us_per_job": round(result["cpu_seconds"] / items * 1e6, 1),
           "broker_cpu_us_per_job": None if beam_cpu is None
           else round(beam_cpu / items * 1e6, 1),
           "finished": result["finished"], "queued_before": queued, "left_in_queue": left,
           "all_done": ok, "enqueue_seconds": round(enqueued - started, 3)}
    progress(f"{label}: celery {config.label:14} {doc['jobs_per_s']:>8.0f} jobs/s  "
             f"({seconds:.2f}s, {'ok' if ok else 'MISMATCH'})")
    if not ok:
        raise RuntimeError(f"celery {config.label}: queued {queued}, finished "
                           f"{result['finished']}, left {left}")
    return doc
