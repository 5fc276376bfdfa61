"""What happened in the ledger minute by minute, kept for the console's charts so that they
need no Prometheus: each process's tally of what it saw (`tally`), the tables it is added
to and the leader's samples of the backlog, and the bucketed series the charts read
(`minutes`), and the leader's sampling loop (`sampler`).
"""
