"""The object store backend: checkpoints on object stores through fsspec (``s3://`` with s3fs,
``gs://``, ``az://``, ``memory://``, ``file://``). :class:`~.folder.ObjectStore`, the writer and
reader; same files and metadata as a local checkpoint; the commit point is the
``metadata.json`` object, written last (``store.py`` describes the protocol). Imports nothing of
``filesystem/``.

May import ``encoding``, ``format``, ``host_memory``, ``planning``, the package's contracts,
``utils`` and the optional fsspec (through ``_optional``).
"""
