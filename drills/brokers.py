"""Drills in broker mode (SWEEPER_EXECUTION=rabbitmq, drills/broker_stage.py): a replica
SIGKILLed mid-drain, the broker itself killed and restarted, one node of a three-node
cluster lost, and a replica cut from the broker but not from PostgreSQL.

Judged from outside as the network drills are (drills/history.py: the upstream's own log
against the ledger), and the broker's queues: every message settled in the end, none
dead-lettered."""

from __future__ import annotations

import asyncio
import signal
import time

from drills import partitions
from drills.base import Drill, Facts, check
from drills.broker_stage import BrokerStage
from drills.faultproxy import FaultProxy
from drills.history import judge
from drills.links import by_worker, worker
from drills.pgserver import PrivateServer
from drills.scratch import create_database
from drills.stage import Stage, free_port
from drills.upstream import FakeUpstream

LEASE_S = 6
OUTAGE_S = 4.0
RATE, BURST = 80, 5
ITEMS = 1200


async def _drain_start(stage: Stage, nodes: int = 1) -> tuple[FakeUpstream, BrokerStage,
                                                               list[str]]:
    """The upstream, the broker, two broker-mode workers (`a` and `b`) calling, and the
    keys of ITEMS items released (handed to the broker by the drill's relay)."""
    upstream = stage.start_upstream()
    stage.write_policies(rate=RATE, burst=BURST, lease=LEASE_S, timeout=3)
    broker = await BrokerStage.open(stage, nodes)
    keys = await stage.register([f"o{i}" for i in range(ITEMS)])
    procs = [worker(stage, name, broker.env) for name in ("a", "b")]
    await stage.wait_started(*procs)
    await stage.release()
    await _both_calling(stage, upstream)
    return upstream, broker, keys


async def _both_calling(stage: Stage, upstream: FakeUpstream) -> None:
    """Wait until replicas `a` and `b` have each made 50 calls."""
    async def both() -> bool:
        seen = by_worker(upstream.calls())
        return len(seen.get("a", [])) >= 50 and len(seen.get("b", [])) >= 50

    await stage.wait_for("both replicas calling", both, 60, 0.05)


async def _finish(stage: Stage, upstream: FakeUpstream, broker: BrokerStage,
                  keys: list[str], facts: Facts) -> Facts:
    """Wait for every item, judge the history, and see the queues emptied."""
    await stage.wait_all_finished(ITEMS, 180)
    judged = await judge(stage, upstream.calls(), keys, rate=RATE, burst=BURST, lease_s=LEASE_S)
    facts.update(judged)
    facts.update(await _all_settled(stage, broker))
    check(judged["statuses"] == {"succeeded": ITEMS}, f"items {judged['statuses']}")
    stage.facts.update(facts)
    return facts


async def _all_settled(stage: Stage, broker: BrokerStage) -> Facts:
    """Stop the workers (each hands back whole, published anew, any message it still
    holds unsettled) and read every message left in the broker: copies of messages whose
    items finished meanwhile may wait there (a deferral, a redelivery, a hand-back at the
    stop), but none may carry an item not finished."""
    await stage.stop_all([p for p in stage.procs if p.alive()], exited_ok=True)
    left = await broker.take_all()
    ids = sorted({i for work in left for i in work.item_ids})
    open_ = await stage.fetch("SELECT id FROM items WHERE id = ANY($1::bigint[]) "
                              "AND status NOT IN ('succeeded', 'dead')", ids)
    check(not open_, f"{len(open_)} unfinished items in messages left in the broker")
    return {"messages_left": len(left)}


async def replica_killed(stage: Stage) -> Facts:
    """A replica SIGKILLed mid-drain: its unsettled messages go back to the broker, the
    other replica takes them, and what it had leased waits out its leases."""
    upstream, broker, keys = await _drain_start(stage)
    victim = next(p for p in stage.procs if p.name == "worker1")
    victim.signal(signal.SIGKILL)
    killed_at = time.time()
    facts: Facts = {"killed_after_calls": len(upstream.calls())}
    await _finish(stage, upstream, broker, keys, facts)
    after = [c for c in by_worker(upstream.calls()).get("a", []) if c.wall_time > killed_at + 1]
    check(not after, f"the killed replica called {len(after)} times after it died")
    return facts


async def broker_restarted(stage: Stage) -> Facts:
    """The broker SIGKILLed mid-drain and started again: consumers and the relay
    reconnect by themselves; messages confirmed before the kill come back with it."""
    upstream, broker, keys = await _drain_start(stage)
    [node] = broker.nodes
    node.kill()
    down_at = time.monotonic()
    await node.start()
    facts: Facts = {"broker_down_s": round(time.monotonic() - down_at, 2),
                    "calls_at_kill": len(upstream.calls())}
    return await _finish(stage, upstream, broker, keys, facts)


async def cluster_node_lost(stage: Stage) -> Facts:
    """A three-node cluster loses the node every client is connected to (the queues'
    leader: they were declared there) mid-drain: its quorum queues elect a leader on the
    others, clients reconnect through the Service to a surviving node, nothing is lost."""
    upstream, broker, keys = await _drain_start(stage, nodes=3)
    first = broker.nodes[0]
    first.kill()
    facts: Facts = {"calls_at_loss": len(upstream.calls()), "nodes": 3}
    await stage.wait_all_finished(ITEMS, 180)
    await first.start()  # back, to read the queues and end with a whole cluster
    return await _finish(stage, upstream, broker, keys, facts)


async def replica_cut_from_broker(stage: Stage) -> Facts:
    """One replica's link to the broker blackholed (no reset) for longer than the AMQP
    heartbeat and the leases, its PostgreSQL and upstream still reachable: the broker
    gives its unsettled messages to the other replica, which waits out the leases it holds;
    its late acks fail and change nothing; after the heal it consumes again."""
    upstream = stage.start_upstream()
    stage.write_policies(rate=RATE, burst=BURST, lease=LEASE_S, timeout=3)
    broker = await BrokerStage.open(stage)
    keys = await stage.register([f"o{i}" for i in range(ITEMS)])
    link = FaultProxy("127.0.0.1", broker.proxy.port)
    await link.start()
    stage.cleanups.append(link.close)
    cut_env = {**broker.env, "SWEEPER_BROKER_URL": broker.url.replace(
        f":{broker.proxy.port}/", f":{link.port}/")}
    procs = [worker(stage, "a", cut_env), worker(stage, "b", broker.env)]
    await stage.wait_started(*procs)
    await stage.release()
    await _both_calling(stage, upstream)
    link.cut()
    await asyncio.sleep(3 * LEASE_S)  # past the heartbeat (the broker requeues) and leases
    link.heal(reset=True)
    facts: Facts = {"cut_s": 3 * LEASE_S}
    return await _finish(stage, upstream, broker, keys, facts)


async def database_restarted(stage: Stage) -> Facts:
    """PostgreSQL stopped mid-drain for OUTAGE_S and started again: the workers keep their
    messages in hand (none is settled before its outcome is committed, none is lost from
    their books while the ledger cannot sort it), and go on once it is back."""
    server = PrivateServer(stage.workdir / "pg", free_port())
    stage.cleanups.append(server.destroy)
    await server.start()
    stage.db_url = await create_database(server.url, "sweeper")
    upstream, broker, keys = await _drain_start(stage)
    await server.stop()
    await asyncio.sleep(OUTAGE_S)  # the outage the drill injects
    calls_at_restart = len(upstream.calls())
    await server.start()

    async def calling_again() -> bool:
        return len(upstream.calls()) > calls_at_restart

    recovery = await stage.wait_for("workers calling again", calling_again, 60, 0.05)
    facts: Facts = {"outage_s": OUTAGE_S, "recovery_s": round(recovery, 2)}
    return await _finish(stage, upstream, broker, keys, facts)


async def replica_cut_from_database(stage: Stage) -> Facts:
    """The reverse of broker-replica-partitioned: one replica loses PostgreSQL (both
    directions, no reset) for longer than its leases while it still reaches the broker
    and the upstream (drills/partitions.py's scenario, in broker mode)."""
    broker = await BrokerStage.open(stage)
    facts = await partitions.replica_cut_from_database(stage, env=broker.env)
    facts.update(await _all_settled(stage, broker))
    return facts


DRILLS = [
    Drill(32, "broker-replica-killed",
          "broker mode: 1,200 items at 80/s, two worker replicas consuming one RabbitMQ",
          "SIGKILL one replica mid-drain",
          "0 lost, 0 succeeded twice, none called 3 times (twice only after a lease), "
          "no second over rate + burst, every message settled", replica_killed),
    Drill(33, "broker-restarted",
          "broker mode: as broker-replica-killed",
          "SIGKILL the RabbitMQ node mid-drain and start it again",
          "as broker-replica-killed; consumers and the relay reconnect by themselves",
          broker_restarted),
    Drill(34, "broker-cluster-node-lost",
          "broker mode on a three-node RabbitMQ cluster (quorum queues) behind a proxy "
          "standing for its Service",
          "SIGKILL the node the clients are connected to and the queues were declared on",
          "as broker-replica-killed: a new leader elsewhere, nothing lost", cluster_node_lost),
    Drill(35, "broker-replica-partitioned",
          "broker mode: as broker-replica-killed, one replica reaching the broker through "
          "a link of its own",
          "blackhole that link (no reset) for three lease lengths, then heal it",
          "as broker-replica-killed; the cut replica's unsettled messages go to the other",
          replica_cut_from_broker),
    Drill(36, "broker-database-restart",
          "broker mode: as broker-replica-killed, on a PostgreSQL server of the drill's own",
          f"stop PostgreSQL (fast shutdown) mid-drain for {OUTAGE_S:.0f} s, then start it",
          "as broker-replica-killed; the workers call again once it is back",
          database_restarted),
    Drill(37, "broker-replica-cut-from-database",
          "broker mode: 1,500 items at 80/s, two worker replicas, one reaching PostgreSQL "
          "through the drill's proxy",
          "blackhole that replica's link to PostgreSQL for 2.5 lease lengths (it still "
          "reaches the broker and the upstream), then heal it",
          "as replica-cut-from-database: no call later than its leases into the cut, the "
          "other replica takes its items over; every message settled",
          replica_cut_from_database),
]
