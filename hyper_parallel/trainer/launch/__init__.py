"""A job's start and stop: the pre-start checks (``preflight.py``), the start from in-memory
snapshots after a restart (``recovery.py``), the cooperative stop on SIGTERM and what the job
reports in words (``reporting.py``).

May import every other part of ``trainer`` but ``loop``.
"""
