"""Runs: a cron trigger records a cutoff, discovery finds a source's candidates
(`discovery`), and publication releases due items into batches (`publication`).
"""
