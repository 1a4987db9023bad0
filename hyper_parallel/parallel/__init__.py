"""The ways a model is split beside ``fully_shard``, each on torch's own machinery.

``tensor`` is tensor parallelism's loss over vocabulary-sharded logits (the plans that shard a
model live with the model, e.g. ``models.llama_parallel``); ``pipeline`` runs ``fully_shard``-ed
stage modules on ``torch.distributed.pipelining`` (stage layouts, the sharded stage,
schedules); ``context`` splits sequences over a context-parallel group (layouts, document
masks, the context the models' attention reads, the token loss) and ``ring_attention`` is the
attention under it, built from the block math of ``block_attention``; ``expert`` dispatches a
mixture of experts' tokens over an ``ep`` mesh (all-to-all).

May import (beside torch): ``hyper_parallel._torch_compat``, ``core`` (the ``fully_shard``
module type), ``chunked_loss`` and ``utils``; never ``models``, ``trainer``, ``data``,
``checkpoint`` or the recipes: the models import ``context`` and ``ring_attention``, and the
trainer puts the pieces together (tests/test_import_cycles.py checks it).
"""
