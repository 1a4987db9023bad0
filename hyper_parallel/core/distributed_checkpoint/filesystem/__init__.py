"""Checkpoints as directories on a file system: the writer and reader, the data files, the
commit protocol (pending directory, markers, committed metadata), and the read paths (whole
blocks, bounced boxes)."""
