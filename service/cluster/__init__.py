"""What the replicas of one deployment agree on: the leader that runs the duties that must
run once (`leader`), among them Sweeper's pruning of its own history (`retention`).
"""
