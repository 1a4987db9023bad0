"""What a training job is built from: the device mesh and the model on it (built on meta,
tensor-, context- and expert-parallel, pipeline stages, activation checkpointing, compile,
float8, ``fully_shard``), and the optimizer.

May import (besides torch and the library below ``trainer``): ``trainer.config`` and
``trainer.observability`` (a layer test, ``tests/recipes/test_trainer_layers.py``, holds every
subpackage of ``trainer`` to the layers listed in ``trainer/__init__.py``).
"""
