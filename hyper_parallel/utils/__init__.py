"""Small helpers shared by the whole package, with no distributed or checkpoint semantics:
durable file writes (``fileio``), host reads of tensor values (``host_reads``), rank and world
size without a process group (``ranks``), byte counts for people (``units``).

May import ``_torch_compat`` only.
"""
