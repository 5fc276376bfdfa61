"""The worker: claims items, calls the upstream, commits outcomes. Its modules, each one
concept, the pool seeing the outside only through its ports:

- `pool.py`: the loop around one admission round (`WorkerPool.run_once`): warm-up,
  polling and wake-ups, flushes, shutdown;
- `calls.py`: a call, the items one request carries (grouping, batch key, confirmation
  reads);
- `attempts.py`: each call's attempt: its moment, its slot, made or handed back;
- `attempt_outcomes.py`: what a call's answer makes of its items (the Completions);
- `pending_writes.py`: outcomes, hand-backs and scope signals waiting for the database;
- `flush_buffer.py`: the bounded buffer each kind of write waits in;
- `signals.py`: scope effects gathered between flushes (the policy:
  service.budget.answer_effects);
- `pacing.py`: the calls allowed in flight, the scope cache, local holds, the database clock;
- `hold_gate.py`, `hold_watch.py`: legal holds bind at the send, and how a pool learns them;
- `pipeline_metrics.py`: the pipeline's Prometheus series, counted per batch;
- `ports.py`: what the pool needs from outside (admission, completion, scope signals,
  upstream calls, clock, wake-ups, holds), as Protocols;
- `postgres.py`: the ledger ports on PostgreSQL and LISTEN wake-ups; `upstream_calls.py`:
  the call port; `local_ports.py`: the clocks, and no wake-ups or holds;
- `process.py`: wiring a pool on a database, and the `sweeper worker` process;
  `health.py`: its probes; `scope_resumption.py`: scopes resumed when what they wait for
  arrives.
"""

from service.worker.pool import WorkerPool, worker_name
from service.worker.ports import Ports
from service.worker.process import database_pool, run_worker_process

__all__ = ["Ports", "WorkerPool", "database_pool", "run_worker_process", "worker_name"]
