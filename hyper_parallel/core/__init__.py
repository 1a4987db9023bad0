"""The runtime's core: ``fully_shard`` (FSDP/HSDP over DTensor parameters, its hooks, streams
and collectives), ``distributed_checkpoint`` (sharded safetensors checkpoints: planning,
storage, async saves, resharding loads, DCP interop), the gradient norm over meshes and the
shard layout helpers both share.

May import (beside torch): ``hyper_parallel._torch_compat``, ``_optional``, ``platform`` and
``utils``; never ``models``, ``parallel``, ``trainer`` or ``data``.
"""
