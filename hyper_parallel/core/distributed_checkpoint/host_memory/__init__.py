"""Host memory of saves and loads: the process-wide pool of slabs (``slabs.py``), a save's
snapshot copied through it (``snapshot.py``) and the background saver of async saves
(``background.py``)."""
