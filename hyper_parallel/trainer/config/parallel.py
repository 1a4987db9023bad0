"""The ``parallel`` config group: how the world factors into pipeline, data-parallel and
tensor-parallel ranks, and what each degree cannot split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

from hyper_parallel.parallel.context import Rotate
from hyper_parallel.models.llama import LlamaConfig
from hyper_parallel.models.moe import MoEConfig
from hyper_parallel.parallel.pipeline import stage_layers, stages_per_rank
from hyper_parallel.trainer.config.rules import key

# torch.distributed.pipelining's schedules, by the names the config takes.
PP_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
DEFAULT_PP_SCHEDULE = "1F1B"  # parallel.pp_schedule=null
CP_ROTATE = tuple(r.value for r in Rotate)  # parallel.cp_rotate's choices


@dataclass(frozen=True)
class ParallelDims:
    """The layout of the world: ``pp`` pipeline stages x ``replicate`` x ``shard``
    data-parallel ranks x ``cp`` context-parallel ranks x ``tp`` tensor-parallel ranks,
    row-major (the ``tp`` ranks of one data-parallel rank are adjacent; a pipeline stage's
    ranks are a contiguous block). The ``cp`` ranks of one data-parallel rank read the same
    samples, each its part of every sequence; FSDP shards parameters over ``shard x cp``."""

    replicate: int
    shard: int
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def dp_size(self) -> int:
        return self.replicate * self.shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_size * self.cp * self.tp

    @property
    def loss_ranks(self) -> int:
        """How many ranks hold a loss: those of the last pipeline stage (all ranks without PP)."""
        return self.dp_size * self.cp * self.tp

    def dp_rank(self, rank: int) -> int:
        """The data-parallel index of global ``rank`` (its slice of each global batch)."""
        return (rank // (self.cp * self.tp)) % self.dp_size

    def pp_rank(self, rank: int) -> int:
        """The pipeline index of global ``rank``."""
        return rank // (self.dp_size * self.cp * self.tp)

    @property
    def mesh_shape(self) -> Dict[str, int]:
        """The device mesh's dims, name -> size in mesh order ``pp, replicate, shard, cp, tp``,
        each present when its degree is above 1 (``shard`` always): ``{"shard": 8}`` for FSDP,
        ``{"replicate": 2, "shard": 4}`` for HSDP, ``{"pp": 2, "shard": 4}`` for PP x FSDP,
        ``{"shard": 2, "cp": 2}`` for FSDP x CP."""
        degrees = (("pp", self.pp), ("replicate", self.replicate), ("shard", self.shard), ("cp", self.cp),
                   ("tp", self.tp))
        return {name: size for name, size in degrees if size > 1 or name == "shard"}


@dataclass
class ParallelConfig:
    """The ``parallel`` group (``fsdp``, ``hsdp``): the mesh and precision.

    The world factors as ``pp x dp_replicate x dp_shard x cp x tp`` (mesh dims in that order)."""

    dp_replicate: int = key(1, min=1)
    dp_shard: int = key(-1, min=-1)                 # -1: the rest of the world (world_size / (pp x dp_replicate x tp))
    tp: int = key(1, min=1)                         # tensor-parallel degree (Megatron-style plan, within a node)
    pp: int = key(1, min=1)                         # pipeline-parallel degree (stages of consecutive blocks)
    pp_schedule: Optional[str] = key(None, choices=PP_SCHEDULES)  # null: 1F1B; Interleaved1F1B: 2 stages per rank
    pp_microbatches: Optional[int] = key(None, min=1)  # pipeline micro-batches per grad-accum step (null: 2 x stages)
    pp_layers_per_stage: Optional[List[int]] = key(None, min=1)  # blocks of each stage, in order (null: an even split)
    mixed_precision: str = key("fp32", choices=("fp32", "bf16"))  # bf16: bf16 compute, fp32 master weights and reduction
    reshard_after_forward: bool = key(True)
    cp: int = key(1, min=1)                         # context-parallel degree: each sequence split over cp ranks
    cp_rotate: str = key("ring", choices=CP_ROTATE)  # how K/V blocks reach every CP rank: ring | allgather
    ep: int = key(1, min=1)                         # expert-parallel degree (model.moe): experts over ep of the dp_shard x cp ranks

    def resolve(self, world_size: int) -> Tuple[Optional[ParallelDims], Optional[str]]:
        """The mesh shape (``dp_shard=-1``: the rest of the world), or why it does not factor
        ``world_size``."""
        pp, replicate, shard, tp, cp = self.pp, self.dp_replicate, self.dp_shard, self.tp, self.cp
        if shard == -1:
            if world_size % (pp * replicate * cp * tp):
                fixed = " x ".join(f"parallel.{k}={v}" for k, v in (("pp", pp), ("dp_replicate", replicate),
                                                                    ("cp", cp), ("tp", tp)) if v > 1)
                return None, f"{fixed or 'parallel.dp_replicate=1'} does not divide the world size {world_size}"
            shard = world_size // (pp * replicate * cp * tp)
        if shard < 1 or pp * replicate * shard * cp * tp != world_size:
            with_pp = f"parallel.pp={pp} x " if pp > 1 else ""
            with_tp = (f" x parallel.cp={cp}" if cp > 1 else "") + (f" x parallel.tp={tp}" if tp > 1 else "")
            return None, (f"{with_pp}parallel.dp_replicate={replicate} x parallel.dp_shard={self.dp_shard}{with_tp} "
                          f"does not factor the world size {world_size} (use dp_shard=-1 for the rest of the world)")
        return ParallelDims(replicate, shard, tp, pp, cp), None

    def split_problems(self, llama: LlamaConfig, seq_len: int) -> List[str]:
        """What tensor parallelism cannot split: heads, kv-heads, the MLP's hidden size, the
        vocabulary (vocab-parallel embedding and output) and the sequence (sequence-parallel
        norms) must each divide by ``tp``."""
        if self.tp == 1:
            return []
        sizes = {"model.n_heads": llama.n_heads, "model.n_kv_heads": llama.n_kv_heads,
                 "model.ffn_hidden_dim": llama.ffn_hidden_dim, "model.vocab_size": llama.vocab_size,
                 "training.seq_len": seq_len}
        bad = [f"{name}={size}" for name, size in sizes.items() if size % self.tp]
        if not bad:
            return []
        each, them = ("each", "them") if len(bad) > 1 else ("it", "it")
        return [f"parallel.tp={self.tp} does not divide {', '.join(bad)} (tensor parallelism splits {each} "
                f"over the tp ranks; pick a tp that divides {them})"]

    def cp_problems(self, seq_len: int) -> List[str]:
        """What context parallelism cannot do yet: split a ``seq_len`` that is not a multiple of
        ``2 x cp`` (the head-tail layout's chunks), or, with tensor parallelism, whose CP part
        (``seq_len / cp``) the sequence-parallel norms cannot split over ``tp``; and a
        ``cp_rotate`` other than the default without CP, where it would do nothing."""
        if self.cp == 1:
            return [] if self.cp_rotate == Rotate.RING.value else [
                f"parallel.cp_rotate={self.cp_rotate} needs parallel.cp > 1 (it is how K/V blocks travel between CP ranks)"]
        cp, problems = f"parallel.cp={self.cp}", []
        if seq_len % (2 * self.cp):
            problems.append(f"training.seq_len={seq_len} is not divisible by 2 x {cp} = {2 * self.cp} (each "
                            "sequence is cut in 2 x cp chunks, a head and a tail chunk per CP rank)")
        elif (seq_len // self.cp) % self.tp:
            problems.append(f"training.seq_len={seq_len} / {cp} = {seq_len // self.cp} tokens per CP rank is not "
                            f"divisible by parallel.tp={self.tp} (the sequence-parallel norms split each CP "
                            "rank's part over the tp ranks)")
        return problems

    @property
    def schedule(self) -> str:
        """The pipeline schedule's name: ``pp_schedule``, by default 1F1B."""
        return self.pp_schedule if self.pp_schedule is not None else DEFAULT_PP_SCHEDULE

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all: ``pp`` x the schedule's stages per rank."""
        return self.pp * stages_per_rank(self.schedule)

    @property
    def microbatches(self) -> int:
        """``pp_microbatches``, by default twice the stages (1F1B's bubble then at most a third)."""
        return self.pp_microbatches if self.pp_microbatches is not None else 2 * self.num_stages

    def pipeline_problems(self, llama: Union[LlamaConfig, MoEConfig], micro_batch: Optional[int],
                          tie_embeddings: bool) -> List[str]:
        """What pipeline parallelism cannot split: the blocks of the model's shape (``llama``, a
        Llama's or a mixture of experts') over the stages
        (``pp_layers_per_stage``), the per-rank micro-batch (``micro_batch`` samples, None when
        it is not a whole number) over ``pp_microbatches``, and tied embeddings (the embedding
        is on the first stage, the output on the last); with ``pp=1``, pipeline settings given
        anyway."""
        if self.pp == 1:  # a pipeline setting without a pipeline is a mistake, not a no-op
            settings = (("pp_schedule", self.pp_schedule), ("pp_microbatches", self.pp_microbatches),
                        ("pp_layers_per_stage", self.pp_layers_per_stage))
            unused = [f"parallel.{k}={v}" for k, v in settings if v is not None]
            return [f"{', '.join(unused)} needs parallel.pp > 1 (it has no effect with parallel.pp=1); "
                    "set parallel.pp or remove it"] if unused else []
        pp, problems = f"parallel.pp={self.pp}", []
        layout = f"{pp} with parallel.pp_schedule={self.schedule} ({self.num_stages} stages)"
        try:
            stage_layers(llama.n_layers, self.num_stages, self.pp_layers_per_stage)
        except ValueError as err:
            given = f"parallel.pp_layers_per_stage={self.pp_layers_per_stage} with " if self.pp_layers_per_stage else ""
            problems.append(f"{given}{layout} and model.n_layers={llama.n_layers}: {err}")
        if tie_embeddings:
            problems.append(f"model.tie_embeddings=true with {pp} is not supported (the embedding is on the first "
                            "stage, the output layer on the last); untie them or set parallel.pp=1")
        m = self.microbatches
        given = (f"parallel.pp_microbatches={m}" if self.pp_microbatches is not None
                 else f"parallel.pp_microbatches=null (2 x {self.num_stages} stages = {m})")
        if micro_batch is not None and micro_batch % m:
            problems.append(f"{given} does not divide the per-rank micro-batch of {micro_batch} samples "
                            "(training.global_batch_size / data-parallel ranks / training.grad_accum_steps); "
                            "set parallel.pp_microbatches to a divisor of it, or change the batch")
        elif self.schedule != "GPipe" and m < self.pp:
            problems.append(f"{given} is fewer than {pp} ({self.schedule} needs at least one "
                            "micro-batch per pipeline rank)")
        elif self.schedule == "Interleaved1F1B" and m % max(1, m // self.pp):
            problems.append(f"{given} with {pp}: Interleaved1F1B needs a multiple of its "
                            f"{m // self.pp} rounds (parallel.pp_microbatches // parallel.pp)")
        return problems

    def moe_problems(self, num_experts: int, dims: Optional[ParallelDims]) -> List[str]:
        """What a mixture-of-experts model (``model.moe``) cannot run with yet: tensor parallelism
        (no TP plan for the experts: use ``ep``); and an ``ep`` that does not divide ``dp_shard x
        cp`` and ``num_experts``. Pipeline parallelism is supported (each stage's MoE layers
        attach their aux loss to their outputs), and so are context parallelism (the CP ranks of
        a sequence balance its tokens together) and float8 (on the dense linears)."""
        unsupported = [f"parallel.{name}={value}" for name, value in (("tp", self.tp),)
                       if isinstance(value, int) and value > 1]
        problems = [f"{', '.join(unsupported)} with model.moe is not supported yet (the recipe runs MoE models "
                    "with data, expert, pipeline and context parallelism only); remove it or use a Llama model"] \
            if unsupported else []
        return problems + self.ep_problems(num_experts, dims)

    def ep_problems(self, num_experts: Optional[int], dims: Optional[ParallelDims]) -> List[str]:
        """Where ``ep`` cannot split: it needs an MoE model (``num_experts`` not None) and must
        divide the ``dp_shard x cp`` ranks (of each replica under HSDP; what ``fully_shard``
        shards over) and the experts."""
        ep = self.ep
        if not isinstance(ep, int) or ep == 1:
            return []
        if num_experts is None:
            return [f"parallel.ep={ep} needs a mixture-of-experts model (model.moe); set parallel.ep=1 or use one"]
        problems = []
        if num_experts % ep:
            problems.append(f"parallel.ep={ep} does not divide model.moe.num_experts={num_experts} "
                            "(each ep rank holds num_experts / ep experts)")
        return problems + self.ep_rank_problems(dims)

    def ep_rank_problems(self, dims: Optional[ParallelDims]) -> List[str]:
        """Where ``ep`` does not divide the ``dp_shard x cp`` ranks (of each replica under HSDP)
        that the experts are split over (empty: it does, or ``ep`` is 1)."""
        ep = self.ep
        if not isinstance(ep, int) or ep == 1 or dims is None or not (dims.shard * dims.cp) % ep:
            return []
        ranks = f"{dims.shard} dp_shard" if dims.cp == 1 else f"{dims.shard} x {dims.cp} dp_shard x cp"
        return [f"parallel.ep={ep} does not divide the {ranks} ranks (expert "
                "parallelism splits the experts over ep of them)"]
