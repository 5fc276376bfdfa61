"""Execution on a broker (SWEEPER_EXECUTION=rabbitmq): the ledger keeps every item, lease,
outcome and the idempotency key; a broker carries which items may be ready.

Which module owns what:
- `work`: `Work`, what a message carries (ledger ids and where they came from, nothing else).
- `ports`: the executor port, `Broker` and `Delivery`: what a broker must give.
- `rabbitmq`: the port on RabbitMQ (quorum queues, confirms, acks, delayed requeues).
- `outbox`: the ledger's side: batches and webhook deliveries not yet handed over, and the
  items of messages the broker gave up on, ended dead.
- `relay`: the leader's duty handing the outbox to the broker.
- `sorting`: where each delivered item stands in the ledger.
- `in_hand`: the books of the messages a worker holds unsettled and where their items are.
- `deliveries`: a worker's admissions from the messages in hand (the pool's ports).
"""
