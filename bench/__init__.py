"""Sweeper's benchmark harness: ``python -m bench <benchmark> [options]``.

Each benchmark is a module that exposes a :class:`bench.common.Benchmark` and is listed in
:data:`bench.__main__.BENCHMARKS`; ``python -m bench all`` runs every one of them with its
defaults. Results are one JSON document: the machine, each benchmark's parameters, every
repetition, and medians (the machine is shared and noisy, so medians are what to compare).
"""

from __future__ import annotations
