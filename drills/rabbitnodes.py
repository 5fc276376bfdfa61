"""RabbitMQ nodes a drill owns: extra nodes of the machine's RabbitMQ installation, on
loopback, each with its own name, ports and folder, which the drill may stop, SIGKILL,
restart and join into a cluster.

The machine's own node (5672) is never touched: nodes made in one workdir share an Erlang
cookie of their own (so they may cluster with each other and with nothing else), their
config replaces /etc/rabbitmq's, and their names and ports are fresh for each node, so
parallel runs do not meet. They run as the current user (root is not needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

from drills.base import DrillSkipped
from drills.stage import free_port

RABBIT_BIN: Final = Path("/usr/lib/rabbitmq/bin")
START_TIMEOUT_S: Final = 60
STOP_TIMEOUT_S: Final = 30
CTL_TIMEOUT_S: Final = 60
POLL_S: Final = 0.05  # between probes of a port that is not answering yet
PROBE_S: Final = 2  # for one probe's answer (a stranger on the port may never answer)
# the AMQP 0-9-1 protocol header; a broker that is up answers it with a method frame (1)
AMQP_HEADER: Final = b"AMQP\x00\x00\x09\x01"
FRAME_METHOD: Final = b"\x01"

_serial = itertools.count(1)


class RabbitNodeError(RuntimeError):
    """A node did not do what was asked; the message ends with the tail of its output."""


def require_installation() -> None:
    """DrillSkipped unless rabbitmq-server, rabbitmqctl and erl are here to run nodes."""
    missing = [p.name for p in (RABBIT_BIN / "rabbitmq-server", RABBIT_BIN / "rabbitmqctl")
               if not p.exists()]
    if missing or shutil.which("erl") is None:
        raise DrillSkipped(f"no RabbitMQ installation to run nodes of this drill's own "
                           f"(missing {', '.join(missing) or 'erl'} in {RABBIT_BIN} / PATH)")


def _cookie(workdir: Path) -> None:
    """One random Erlang cookie per workdir, made once (O_EXCL: nodes made at the same
    time agree on it); the file must be readable by its owner only or Erlang refuses it."""
    workdir.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        fd = os.open(workdir / ".erlang.cookie", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.write(secrets.token_hex(20).upper())


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


class RabbitNode:
    """One node, `<name>@localhost`, in `workdir/<name>`. Its ports are chosen once, so a
    restart keeps its URL; its data survives stop, kill and restart until `close()`.

    The server is our direct child (pid = beam = its process group id) and is reaped only
    by `kill()`/`stop()`: until then its group id cannot be anyone else's, so signalling the
    group never reaches a stranger."""

    def __init__(self, workdir: Path, name: str | None = None) -> None:
        require_installation()
        self.workdir = workdir
        self.name = name or f"sweeper-{os.getpid()}-{next(_serial)}-{secrets.token_hex(3)}"
        self.node = f"{self.name}@localhost"
        self.root = workdir / self.name
        self.amqp_port = free_port()
        self.dist_port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/"

    @property
    def running(self) -> bool:
        """Started and not yet exited (checked without reaping it: see the class)."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return False
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        return os.waitid(os.P_PID, proc.pid, flags) is None

    def __repr__(self) -> str:
        return f"RabbitNode({self.node}, amqp={self.amqp_port}, dist={self.dist_port})"

    def _configure(self) -> None:
        """The node's files. The port is in its rabbitmq.conf: /etc/rabbitmq's pins 5672,
        and an environment variable alone would not move the listener off it."""
        _cookie(self.workdir)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "rabbitmq.conf").write_text(
            f"listeners.tcp.local = 127.0.0.1:{self.amqp_port}\nloopback_users = none\n")
        (self.root / "rabbitmq-env.conf").write_text(
            f"NODENAME={self.node}\nERL_EPMD_ADDRESS=127.0.0.1\n")
        (self.root / "enabled_plugins").write_text("[].\n")

    def _env(self) -> dict[str, str]:
        """What both the server and rabbitmqctl read: the cookie's home, this node's env
        file (not /etc/rabbitmq's), and nothing of the caller's RABBITMQ_/ERL_ settings."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RABBITMQ_", "ERL_", "NOTIFY_SOCKET"))}
        env.update(HOME=str(self.workdir),
                   RABBITMQ_CONF_ENV_FILE=str(self.root / "rabbitmq-env.conf"),
                   ERL_EPMD_ADDRESS="127.0.0.1",
                   ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}")
        return env

    def _server_env(self) -> dict[str, str]:
        root = self.root
        return self._env() | {
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_CONFIG_FILE": str(root / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(root / "advanced.config"),  # none
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(root / "enabled_plugins"),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(root / "mnesia"),
            "RABBITMQ_LOG_BASE": str(root / "log"),
            "RABBITMQ_PID_FILE": str(root / "rabbitmq.pid"),
            # rabbitmq-server's own switch to exec the VM instead of keeping a shell that
            # forwards signals: beam becomes our child, SIGTERM stops it cleanly itself
            "RUNNING_UNDER_SYSTEMD": "true",
        }

    def _spawn(self) -> None:
        self._configure()
        with (self.root / "server.out").open("ab") as out:
            self._proc = subprocess.Popen(  # noqa: S603 - fixed binary, our own arguments
                [str(RABBIT_BIN / "rabbitmq-server")], cwd=self.root, env=self._server_env(),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)

    def _failure(self, what: str) -> RabbitNodeError:
        return RabbitNodeError(f"{self.node} {what}; its output ends:\n"
                               f"{_tail(self.root / 'server.out')}")

    async def _answers_amqp(self) -> bool:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.amqp_port)
        except OSError:
            return False
        try:
            async with asyncio.timeout(PROBE_S):
                writer.write(AMQP_HEADER)
                await writer.drain()
                return await reader.read(1) == FRAME_METHOD
        except (OSError, TimeoutError):
            return False
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def wait_ready(self) -> None:
        """Until the node answers an AMQP handshake: its listener opens last in boot (and
        last in start_app), so then it takes connections. Fails early if the node died."""
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                while not await self._answers_amqp():
                    if not self.running:
                        raise self._failure("exited while starting")
                    await asyncio.sleep(POLL_S)
        except TimeoutError:
            raise self._failure(f"took no AMQP connection in {START_TIMEOUT_S} s") from None

    async def start(self) -> None:
        """Start (first time: a fresh node; later: on its data, as it was) and wait until it
        takes AMQP connections."""
        if self.running:
            return
        self._reap()
        self._spawn()
        await self.wait_ready()

    async def stop(self) -> None:
        """A clean shutdown (SIGTERM: RabbitMQ stops its apps and syncs its data); SIGKILL
        if it has not ended in STOP_TIMEOUT_S."""
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:  # unreaped: the pid is still ours
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self._reap()

    def kill(self) -> None:
        """SIGKILL the node's process group, as a host lost: no shutdown at all. Returns
        once beam is dead (its epmd name and ports released). Its helper erl_child_setup
        lives in a session of its own and exits when beam is gone."""
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:  # unreaped: the group id is still ours
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self._proc = None

    def _reap(self) -> None:
        """Forget a server that has ended (a clean exit, or a crash found by `running`)."""
        if self._proc is not None and not self.running:
            self._proc.wait()
            self._proc = None

    async def restart(self) -> None:
        """Stop if running, then start on the same data: its queues, users and cluster
        membership come back."""
        await self.stop()
        await self.start()

    async def ctl(self, *args: str) -> str:
        """`rabbitmqctl -n <node> args`; its stdout. RabbitNodeError if it fails.
        Each call listens on a free port of its own: rabbitmqctl's default range holds 11
        ports for the whole machine, which parallel runs would exhaust."""
        port = str(free_port())
        env = self._env() | {"RABBITMQ_CTL_DIST_PORT_MIN": port,
                             "RABBITMQ_CTL_DIST_PORT_MAX": port}
        proc = await asyncio.create_subprocess_exec(
            str(RABBIT_BIN / "rabbitmqctl"), "-n", self.node, *args, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            async with asyncio.timeout(CTL_TIMEOUT_S):
                out, err = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise RabbitNodeError(f"rabbitmqctl {' '.join(args)} on {self.node}: no answer "
                                  f"in {CTL_TIMEOUT_S} s") from None
        if proc.returncode != 0:
            raise RabbitNodeError(f"rabbitmqctl {' '.join(args)} on {self.node} exited "
                                  f"{proc.returncode}: {(err or out).decode(errors='replace')}")
        return out.decode(errors="replace")

    async def join(self, first: RabbitNode) -> None:
        """Join `first`'s cluster (this node's own data is reset by the join) and wait
        until this node takes connections again."""
        await self.ctl("stop_app")
        await self.ctl("join_cluster", first.node)
        await self.ctl("start_app")
        await self.wait_ready()

    async def running_nodes(self) -> list[str]:
        """The cluster's running nodes as this node sees them."""
        status = json.loads(await self.ctl("cluster_status", "--formatter", "json"))
        return sorted(status["running_nodes"])

    async def close(self) -> None:
        """Stop if running, and delete the node's folder. The epmd name goes with the
        process; the cookie stays with the workdir (its owner removes that)."""
        try:
            await self.stop()
        finally:
            self.kill()  # nothing left if stop worked
            await asyncio.to_thread(shutil.rmtree, self.root, True)


@contextlib.asynccontextmanager
async def rabbit_cluster(n: int, workdir: Path) -> AsyncIterator[list[RabbitNode]]:
    """n nodes started in `workdir` and joined to the first, closed on the way out
    whatever happened (also when starting or joining failed part way)."""
    nodes = [RabbitNode(workdir) for _ in range(n)]
    try:
        async with asyncio.TaskGroup() as group:
            for node in nodes:
                group.create_task(node.start())
        for node in nodes[1:]:  # one at a time: each join changes the cluster's schema
            await node.join(nodes[0])
        yield nodes
    finally:
        await asyncio.gather(*(node.close() for node in nodes), return_exceptions=True)
