"""When each request reached the fake, by the kernel's clock rather than the fake's loop.

A fake that stamps a call when its event loop gets round to parsing it stamps late, and late
in bunches, whenever its loop waits for a core or the GIL: calls spread over a second can be
stamped inside a shorter one, and a drill would then see more calls in a second than the
client sent. The kernel stamps each segment as it arrives (SO_TIMESTAMPNS); the fake reads
its sockets through `ArrivalSocket`, which keeps the stamp of the last bytes it read, so a
request's time is when its last bytes arrived. Where the option is missing (not Linux) the
stamp is the time of the read.
"""

from __future__ import annotations

import socket
import struct
import sys
import time
from typing import Any

# Linux's SO_TIMESTAMPNS (the "old" 64-bit timespec form); the socket module does not name it
SO_TIMESTAMPNS = 35
_TIMESPEC = struct.Struct("@qq")
_ANCILLARY = socket.CMSG_SPACE(_TIMESPEC.size)
KERNEL_STAMPS = sys.platform.startswith("linux")


class ArrivalSocket(socket.socket):
    """An accepted TCP socket whose reads keep the kernel's arrival time (`last_arrival`,
    seconds since the epoch as `time.time()`) of the bytes they returned."""

    last_arrival: float

    @classmethod
    def adopt(cls, sock: socket.socket) -> ArrivalSocket:
        """Take over `sock` (an accepted connection; `sock` is detached)."""
        out = cls(sock.family, sock.type, sock.proto, fileno=sock.detach())
        out.last_arrival = time.time()
        if KERNEL_STAMPS:
            out.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        return out

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        buf = bytearray(bufsize)
        n = self.recv_into(buf, bufsize, flags)
        return bytes(buf[:n])

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        if not KERNEL_STAMPS:
            n = super().recv_into(buffer, nbytes, flags)
            self.last_arrival = time.time()
            return n
        view = memoryview(buffer)
        n, ancillary, _flags, _addr = self.recvmsg_into(
            [view[:nbytes] if nbytes else view], _ANCILLARY, flags)
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                seconds, nanos = _TIMESPEC.unpack(data[:_TIMESPEC.size])
                self.last_arrival = seconds + nanos / 1e9
                break
        else:
            if n:
                self.last_arrival = time.time()
        return n
