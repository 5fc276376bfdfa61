"""Failure drills: the release suite (tests/drills) and `sweeper drill NAME`.

Each drill names its setup, the fault it injects and the assertion it checks, runs real
`sweeper` OS processes against a real PostgreSQL and the fake upstream, and returns what
it measured. `catalog.DRILLS` lists them in issue order.
"""
