"""Per-step throughput (TFLOP/s, MFU), memory, and the torch.profiler / memory-snapshot window."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union

import torch

from hyper_parallel._torch_compat import dump_cuda_memory_snapshot, record_cuda_memory_history
from hyper_parallel.models.llama import LlamaConfig
from hyper_parallel.models.moe import MoEConfig, param_counts
from hyper_parallel.platform import Platform

# Dense bf16 peak TFLOP/s per device (vendor datasheets, without sparsity), matched as a
# substring of the device name, longest first. Set training.peak_tflops for anything else.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H800": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "MI300X": 1307.0,
    "Ascend910B": 313.0,
}


def matmul_params(cfg: Union[LlamaConfig, MoEConfig]) -> int:
    """Parameters that take part in a matrix multiply per token: every block's projections and
    the output head (the embedding is a lookup; norms are negligible and left out). For a
    mixture of experts the active ones: the routed experts a token is not sent to do not count."""
    if isinstance(cfg, MoEConfig):
        counts = param_counts(cfg)
        return counts.active - (0 if cfg.tie_embeddings else counts.embedding)
    head_dim = cfg.dim // cfg.n_heads
    attention = cfg.dim * head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    ffn = 3 * cfg.dim * cfg.ffn_hidden_dim
    return cfg.n_layers * (attention + ffn) + cfg.dim * cfg.vocab_size


def flops_per_token(cfg: Union[LlamaConfig, MoEConfig], seq_len: int) -> float:
    """Training FLOPs per token: ``6 * matmul_params`` (forward + backward) plus attention
    scores and values, ``12 * n_layers * dim * seq_len`` (the PaLM / torchtitan convention;
    activation recomputation is not counted, as in MFU)."""
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layers * cfg.dim * seq_len


def peak_tflops(platform: Platform, configured: Optional[float]) -> Optional[float]:
    """``configured`` if set, else the table's entry for this accelerator; None when unknown (CPU)."""
    if configured:
        return float(configured)
    if not platform.is_accelerator:
        return None
    name = platform.device_module.get_device_name()
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key.replace(" ", "") in name.replace(" ", ""):
            return PEAK_BF16_TFLOPS[key]
    return None


def memory_record(platform: Platform) -> Dict[str, int]:
    """Peak memory of the last step: allocated and reserved on accelerators, RSS on CPU."""
    if platform.is_accelerator:
        return {"memory_bytes": int(platform.device_module.max_memory_allocated()),
                "memory_reserved_bytes": int(platform.device_module.max_memory_reserved())}
    return {"memory_bytes": platform.peak_memory_bytes()}


def model_flops_per_token(model_cfg: Union[LlamaConfig, MoEConfig], seq_len: int,
                          meta_model: Optional[torch.nn.Module] = None) -> float:
    """:func:`flops_per_token` of the project's model of ``model_cfg``, or, given a ``transformers``
    model (``model=hf``: the one validation built on the meta device), counted over its own
    modules (:func:`hyper_parallel.models.hf_sizes.flops_per_token`)."""
    if meta_model is None:
        return flops_per_token(model_cfg, seq_len)
    from hyper_parallel.models import hf_sizes

    return hf_sizes.flops_per_token(meta_model, seq_len)


class Throughput:
    """``tflops`` per device and ``mfu`` (None where the peak is unknown) from a step's time."""

    def __init__(self, flops_per_token: float, *, tokens_per_step: int, world_size: int, peak: Optional[float]):
        self.flops_per_step = flops_per_token * tokens_per_step
        self.world_size, self.peak = world_size, peak

    def record(self, step_time_s: float) -> Dict[str, Any]:
        tflops = self.flops_per_step / step_time_s / self.world_size / 1e12
        return {"tflops": tflops, "mfu": tflops / self.peak if self.peak else None}


class ProfilerWindow:
    """torch.profiler over steps ``start .. start + steps - 1`` of this job, one Chrome trace per
    rank in ``folder/trace_rank{R}_steps{A}-{B}.json``; with ``memory_snapshot`` (CUDA only) also
    ``folder/memory_snapshot_rank{R}.pickle`` (open it at https://pytorch.org/memory_viz).

    Call :meth:`before_step` and :meth:`after_step` around every optimizer step.
    """

    def __init__(self, folder: str, *, rank: int, start: int, steps: int, platform: Platform,
                 memory_snapshot: bool):
        self.folder, self.rank, self.start, self.end = folder, rank, start, start + steps - 1
        self.platform, self.memory_snapshot = platform, memory_snapshot and platform.device_type == "cuda"
        self._profiler: Optional[torch.profiler.profile] = None

    def before_step(self, step: int) -> None:
        if step != self.start:
            return
        os.makedirs(self.folder, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.platform.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.memory_snapshot:
            record_cuda_memory_history(200_000)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
        self._profiler.__enter__()

    def after_step(self, step: int) -> Optional[str]:
        """The trace's path when the window closed at ``step``, else None."""
        if self._profiler is None or step < self.end:
            return None
        self.platform.synchronize()
        self._profiler.__exit__(None, None, None)
        path = os.path.join(self.folder, f"trace_rank{self.rank}_steps{self.start}-{self.end}.json")
        self._profiler.export_chrome_trace(path)
        self._profiler = None
        if self.memory_snapshot:
            dump_cuda_memory_snapshot(os.path.join(self.folder, f"memory_snapshot_rank{self.rank}.pickle"))
            record_cuda_memory_history(None)
        return path

    def close(self) -> None:
        """Stop an open window (the run ended inside it) and write what was recorded."""
        if self._profiler is not None:
            self.after_step(self.end)
