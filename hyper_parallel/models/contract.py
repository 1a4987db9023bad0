"""What the recipe needs of a model: :class:`RecipeModel`, declared by every model the recipe
builds (the project's decoders, :class:`~hyper_parallel.models.llama.Transformer` and
:class:`~hyper_parallel.models.moe.MoETransformer`, and a ``transformers`` causal LM through
:class:`~hyper_parallel.models.hf_causal_lm.CausalLMLogits`), so that
``hyper_parallel.trainer.setup.parallelize`` asks the model instead of testing its class."""

from __future__ import annotations

from typing import ClassVar, List, Mapping, Optional

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["RecipeModel"]


class RecipeModel:
    """A model the recipe parallelises block by block: built on the meta device, tensor-parallel
    over its own plan, its blocks checkpointed, compiled and sharded one by one, then
    materialised (``to_empty``) and initialised from a seed.

    A subclass implements :meth:`apply_tensor_parallel` and :meth:`init_from_seed` and sets the
    flags that differ from the defaults (a mixture of experts sets all three, and implements
    :meth:`apply_expert_parallel`). A plain base class,
    not an ``abc.ABC``: ``fully_shard`` assigns a module's ``__class__``, which fails ("object layout
    differs") for a module whose class mixes in ``abc.ABC``.
    """

    #: The blocks by index (``"0"``, ``"1"``, ...), in order: what is checkpointed, compiled and
    #: sharded one by one.
    layers: Mapping[str, nn.Module]

    #: Activation checkpointing records each block's routing in the forward and replays it in
    #: the recomputation (:class:`~hyper_parallel.models.moe_layer.RoutingReplay`), so that the
    #: recomputation sends each token to the experts the forward did.
    replays_routing: ClassVar[bool] = False

    #: A block's body compiles without graph breaks (``torch.compile(fullgraph=True)``); False
    #: where it has data-dependent shapes (a mixture of experts' split of the tokens by expert).
    blocks_compile_fullgraph: ClassVar[bool] = True

    #: The model balances its experts' load over the tokens of a process group (the global
    #: micro-batch): the recipe calls :meth:`set_balance_group` with the data-parallel group.
    balances_load_over_ranks: ClassVar[bool] = False

    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        """Shard the model over the 1-D ``tp_mesh`` by its own tensor-parallel plan (on the meta
        device too: initialise afterwards).

        Raises:
            ValueError: the model has no plan that runs here (the message says what to use).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement apply_tensor_parallel")

    def apply_expert_parallel(self, ep_mesh: DeviceMesh) -> List[nn.Module]:
        """Split the routed experts of every MoE layer over the 1-D ``ep_mesh`` (their weights
        DTensors ``Shard(0)``, ``num_experts / ep`` experts a rank; on the meta device too), their
        tokens sent to the rank holding their expert and back by all-to-all
        (:mod:`hyper_parallel.parallel.expert`). Returns the experts modules, which the recipe
        ``fully_shard``-s over the rest of the data-parallel ranks. A model without experts
        refuses.

        Raises:
            ValueError: the model has no experts it can split over ``ep_mesh`` (the message says
                why and what to use).
        """
        raise ValueError(f"parallel.ep={ep_mesh.size()}: {type(self).__name__} has no experts (a dense model); "
                         "set parallel.ep=1")

    def init_from_seed(self, seed: int) -> None:
        """(Re)initialise every parameter and buffer (plain or sharded, e.g. after ``to_empty``)
        from ``seed``: the same values on every mesh and world size."""
        raise NotImplementedError(f"{type(self).__name__} must implement init_from_seed")

    def use_ring_attention(self) -> None:
        """Make every block's attention run as ring attention under an active
        :func:`~hyper_parallel.parallel.context.context_parallel` (rotary positions the tokens'
        global ones). The project's decoders attend through
        :class:`~hyper_parallel.models.attention.Attention`, which does already: this checks that
        every block has one.

        Raises:
            ValueError: a block the ring cannot run (the message says what to use).
        """
        from hyper_parallel.models.attention import Attention

        for name, block in self.layers.items():
            if not any(isinstance(module, Attention) for module in block.modules()):
                raise ValueError(f"parallel.cp needs the project's attention (hyper_parallel.models.attention."
                                 f"Attention) in every block; block {name} ({type(block).__name__}) has none")

    def set_balance_group(self, group: Optional[dist.ProcessGroup]) -> None:
        """Balance each forward's tokens together with those of ``group``'s ranks (see
        :attr:`balances_load_over_ranks`); a model without routed experts has nothing to balance."""

    def set_aux_loss_scale(self, scale: float) -> None:
        """Declare the factor the training loss is multiplied by before ``backward`` (``1 /
        grad_accum`` for ``(loss / grad_accum).backward()``), by which a model that carries a
        load-balancing loss into the backward scales it; a model without one has nothing to scale.

        Raises:
            ValueError: (a model that scales one) ``scale`` is not a finite number > 0.
        """
