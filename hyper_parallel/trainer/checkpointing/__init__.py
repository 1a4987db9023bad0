"""What a job saves and where it starts from: the training state (``state.py``), the loop's saves,
the start-up's choice of checkpoint (``operations.py``), the in-memory snapshots and their
transfer to a partner rank, the output files and the tokenizer saved beside an export.

May import: ``trainer.config``, ``trainer.observability``, ``trainer.setup``, ``trainer.step``.
"""
