"""The recipe's config: every key's schema, and the config composed, validated and typed.

- ``rules.py``: what one value may be (``key(default, range)`` beside its dataclass field).
- ``parallel.py``: the ``parallel`` group and the world's layout (:class:`ParallelDims`).
- ``model.py``, ``data.py``: the ``model`` group and the ``data`` kinds (one dataclass per kind).
- ``schema.py``: the other groups, the whole config and the checks between keys across groups.
- ``compose.py``: the Hydra composition, its validation against the schema, the typed config.

Where a check lives (each check in one place only; code that runs later trusts it):

1. The config alone, in ``validate_config`` (also ``recipes/train.py --cfg``): each value's
   type and range (``rules.py``, from the schema's annotations and ``key``) and the relations
   between keys (each schema class's ``problems()``; across groups ``TrainConfig.problems``).
   These read nothing but the config: no file, no machine, no installed optional package.
2. The config against the place it runs in, in the pre-start check
   (``preflight.check_environment``: ``recipes/train.py --check`` and every rank before
   start-up): the machine (memory), files and folders (output folders, checkpoints, the data,
   ``model.init_from``) and the optional packages a setting needs.

What only the running job can see (a token id deep in a data file, a checkpoint that does not
fit the model) is checked where it is met, by all ranks together (``step/agreement.py``).

May import ``models`` (shapes and presets), ``parallel.pipeline`` (stage layouts),
``parallel.context``, ``core.distributed_checkpoint.errors`` and ``utils``; no other trainer folder.
"""

from hyper_parallel.trainer.config.compose import (ConfigError, ValidConfig, compose_config, typed_config,
                                                   validate_config)
from hyper_parallel.trainer.config.parallel import ParallelDims
from hyper_parallel.trainer.config.model import llama_config
from hyper_parallel.trainer.config.schema import TrainConfig

__all__ = ["ConfigError", "ParallelDims", "TrainConfig", "ValidConfig", "compose_config", "llama_config",
           "typed_config", "validate_config"]
