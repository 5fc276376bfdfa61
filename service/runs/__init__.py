"""Runs: a cron trigger records a cutoff (`trigger`), discovery finds a source's candidates
(`discovery`, each page sorted by `page_sorting`), publication releases due items into
batches (`publication`), and operators read a run's report and progress (`reports`,
`progress`).
"""
