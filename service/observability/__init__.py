"""What Sweeper tells its operators about itself: every Prometheus series, the structured log
lines, and the loop that survives and counts unexpected errors.
"""
