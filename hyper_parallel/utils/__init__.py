"""Small helpers shared by the whole package, with no distributed or checkpoint semantics:
durable file writes (``fileio``), rank and world size without a process group (``ranks``),
byte counts for people (``units``)."""
