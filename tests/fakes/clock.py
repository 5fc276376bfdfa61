"""A monotonic clock that moves only when the test moves it, for the product's clock seams
(a `monotonic` or `clock` callable: the run progress and console overview caches, the
credential caches, the worker's health): a test of an age or a TTL moves the clock past it
instead of sleeping through it."""

from __future__ import annotations


class ManualClock:
    """Seconds from an arbitrary start, read by calling it; `now` moves only when set."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock `seconds` ahead (never back: it stands for a monotonic clock)."""
        if seconds < 0:
            raise ValueError("a monotonic clock only moves ahead")
        self.now += seconds
