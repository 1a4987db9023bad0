"""Device and backend abstraction: cpu/gloo, cuda/nccl, npu/hccl.

Everything in hyper_parallel asks this layer which device it runs on instead of probing
``torch.cuda`` itself. ``torch_npu`` is imported only when the platform is NPU.

May import torch (and torch_npu where present) only: nothing of hyper_parallel.
"""

from hyper_parallel.platform.platform import (
    Platform,
    free_port,
    get_platform,
    init_distributed,
    reset_platform,
)
from hyper_parallel.platform.streams import AcceleratorStreams, CpuStreams, Streams

__all__ = ["AcceleratorStreams", "CpuStreams", "Platform", "Streams", "free_port", "get_platform",
           "init_distributed", "reset_platform"]
