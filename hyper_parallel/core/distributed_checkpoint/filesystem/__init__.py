"""The file system backend: checkpoints as directories on a local or mounted file system.
:class:`~.folder.LocalStore`, the writer and reader, the data files as local files, the commit
protocol (pending directory, markers, committed metadata), a folder's ``flock`` and the block
reads. Imports nothing of ``object_store/``.

May import ``encoding``, ``format``, ``host_memory``, ``planning``, the package's contracts,
``platform`` and ``utils``.
"""
