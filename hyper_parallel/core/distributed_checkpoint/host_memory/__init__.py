"""Host memory of saves and loads: the process's staging buffers, a pool of fixed-size slabs
(``staging_buffers.py``), a save's snapshot copied through them by its copy stages
(``snapshot.py``), loads' boxes bounced through them (``bounce.py``) and the background saver
of async saves (``background.py``).

May import ``format``, the package's contracts and ``platform`` (streams, pinned memory).
"""
