"""Save and load planning: which rank writes or reads which chunk, the global save plan and
metadata, the cached plan of repeated saves, verification duties of loads, and the
coordinator's collective steps.

May import ``format``, the package's contracts, ``core.layout`` and ``utils``.
"""
