"""One training step and what runs between steps: the optimizer step over micro-batches
(``train_step.py``), the learning-rate schedule, the periodic evaluation, and how the ranks
agree after each step (``agreement.py``: sums, votes, failing together).

May import: ``trainer.config``, ``trainer.observability``, ``trainer.setup``.
"""
