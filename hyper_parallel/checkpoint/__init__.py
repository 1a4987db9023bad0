"""Alias of :mod:`hyper_parallel.core.distributed_checkpoint` (``hp.checkpoint``).

May import ``core.distributed_checkpoint`` only.
"""

from hyper_parallel.core.distributed_checkpoint import *  # noqa: F401,F403
from hyper_parallel.core.distributed_checkpoint import __all__  # noqa: F401
