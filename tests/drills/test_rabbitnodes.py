"""RabbitMQ nodes of a test's own: a three-node cluster keeps every confirmed message of a
quorum queue through the SIGKILL of a node, the killed node rejoins on restart, and no node
outlives the test."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import pytest

from drills.base import DrillSkipped
from drills.rabbitnodes import RabbitNode, rabbit_cluster, require_installation

# every test here starts processes (see the marker in pyproject.toml)
pytestmark = pytest.mark.slow

MESSAGES = 200
QUEUE = "drill.quorum"


@pytest.fixture
def workdir() -> Iterator[Path]:
    # not pytest's tmp_path: a second pytest session on the machine prunes old basetemps,
    # which would delete the nodes' data under them mid-run
    with tempfile.TemporaryDirectory(prefix="sweeper-test-rabbit-",
                                     ignore_cleanup_errors=True) as path:
        yield Path(path)


def strays(nodes: list[RabbitNode]) -> str:
    """The command lines of processes still carrying one of the nodes' names."""
    found = [subprocess.run(["pgrep", "-af", node.name], capture_output=True, text=True,
                            check=False).stdout for node in nodes]
    return "".join(found)


async def publish(url: str, count: int) -> None:
    """Declare the quorum queue and publish `count` persistent messages, each confirmed."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(QUEUE, durable=True,
                                    arguments={"x-queue-type": "quorum"})
        for i in range(count):  # publish() returns once the broker confirmed the message
            await channel.default_exchange.publish(
                aio_pika.Message(str(i).encode(),
                                 delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=QUEUE)


async def consume_all(url: str, expected: int) -> list[str]:
    """Every message of the queue, acknowledged, in the order delivered; then checks that
    the queue holds nothing more."""
    bodies: list[str] = []
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=50)
        queue = await channel.declare_queue(QUEUE, passive=True)
        async with queue.iterator(timeout=30) as messages:
            async for message in messages:
                async with message.process():
                    bodies.append(message.body.decode())
                if len(bodies) == expected:
                    break
        left = await queue.get(fail=False)
        assert left is None, f"a message beyond the {expected}: {left.body!r}"
    return bodies


def skip_without_rabbitmq() -> None:
    """Skips without a RabbitMQ installation (fails under SWEEPER_REQUIRE_TOOLS)."""
    try:
        require_installation()
    except DrillSkipped as exc:
        if os.environ.get("SWEEPER_REQUIRE_TOOLS"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))


async def test_quorum_queue_survives_sigkill_of_a_node_and_the_node_rejoins(
        workdir: Path) -> None:
    skip_without_rabbitmq()
    async with rabbit_cluster(3, workdir) as nodes:
        first, victim, survivor = nodes
        names = sorted(node.node for node in nodes)
        assert await first.running_nodes() == names

        await publish(first.url, MESSAGES)
        victim.kill()
        assert not victim.running

        bodies = await consume_all(survivor.url, MESSAGES)
        assert sorted(bodies, key=int) == [str(i) for i in range(MESSAGES)]

        await victim.restart()
        assert await victim.running_nodes() == names
        connection = await aio_pika.connect(victim.url)
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(QUEUE, passive=True)
            assert queue.declaration_result.message_count == 0
    assert strays(nodes) == ""
