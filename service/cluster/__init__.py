"""What the replicas of one deployment agree on: the leader that runs the duties that must
run once.
"""
