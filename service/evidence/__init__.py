"""Deletion evidence: signing keys (`signing`), one deletion's record (`deletion_records`), the
chained log with its signed checkpoints (`chain`), exports as slices of it (`export_slices`)
and their offline verification (`verification`).
"""
