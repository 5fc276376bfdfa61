"""The worker: claims items, calls the upstream, commits outcomes.

- `pool.py`: the rounds, the attempts and the loop (ports only, no I/O of its own);
- `ports.py`: what the pool needs from outside (admission, completion, scope signals,
  upstream calls, clock, wake-ups);
- `pacing.py`: the calls allowed in flight, the scope cache, local holds, the database clock;
- `signals.py`: scope effects gathered between flushes (the policy: service.budget.answer_effects);
- `postgres.py`: the ledger ports on PostgreSQL and LISTEN wake-ups;
- `process.py`: wiring a pool on a database, and `sweeper worker`.
"""

from service.worker.pool import WorkerPool, worker_name
from service.worker.ports import Ports
from service.worker.process import database_pool, run_worker_process

__all__ = ["Ports", "WorkerPool", "database_pool", "run_worker_process", "worker_name"]
