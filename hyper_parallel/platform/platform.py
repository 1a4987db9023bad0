"""Which accelerator and collective backend this process uses, and the process group setup."""

from __future__ import annotations

import ctypes
import datetime
import importlib
import importlib.util
import os
import resource
import socket
import warnings
import weakref
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from hyper_parallel.platform.streams import AcceleratorStreams, CpuStreams, Streams

# device type -> collective backend
_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
_DEVICE_ENV = "HYPER_PARALLEL_DEVICE"


def _npu_available() -> bool:
    # Only look for torch_npu when it is installed; importing it registers the "npu" device.
    if importlib.util.find_spec("torch_npu") is None:
        return False
    importlib.import_module("torch_npu")
    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def _detect_device_type() -> str:
    forced = os.environ.get(_DEVICE_ENV)
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(
                f"{_DEVICE_ENV}={forced!r} is not one of {sorted(_BACKENDS)}"
            )
        if forced == "npu":
            importlib.import_module("torch_npu")
        return forced
    if torch.cuda.is_available():
        return "cuda"
    if _npu_available():
        return "npu"
    return "cpu"


@dataclass(frozen=True)
class Platform:
    """What this process runs on.

    Attributes:
        device_type: ``"cpu"``, ``"cuda"`` or ``"npu"``.
        backend: the collective backend for that device (``gloo``, ``nccl``, ``hccl``).
    """

    device_type: str
    backend: str

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))

    @property
    def world_size(self) -> int:
        if dist.is_initialized():
            return dist.get_world_size()
        return int(os.environ.get("WORLD_SIZE", 1))

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def is_accelerator(self) -> bool:
        return self.device_type != "cpu"

    @property
    def device_module(self):
        """``torch.cuda`` / ``torch.npu``; None on CPU."""
        return torch.get_device_module(self.device_type) if self.is_accelerator else None

    def current_device(self) -> torch.device:
        """The device this rank computes on (``cuda:<local_rank>`` etc., or ``cpu``)."""
        if not self.is_accelerator:
            return torch.device("cpu")
        return torch.device(self.device_type, self.device_module.current_device())

    def set_device(self) -> torch.device:
        """Bind this process to ``LOCAL_RANK``'s accelerator; returns the device."""
        if self.is_accelerator:
            self.device_module.set_device(self.local_rank)
        return self.current_device()

    def use_device(self, device: torch.device) -> None:
        """Make ``device`` the calling thread's current accelerator (the current device is per
        host thread, and a new thread starts on device 0). No-op on CPU."""
        if self.is_accelerator:
            self.device_module.set_device(device)

    def synchronize(self) -> None:
        if self.is_accelerator:
            self.device_module.synchronize()

    def streams(self) -> Streams:
        """The side streams fully_shard overlaps its collectives on (no-ops on CPU); created on
        first use, once per process."""
        global _STREAMS
        if _STREAMS is None:
            _STREAMS = AcceleratorStreams(self.device_module) if self.is_accelerator else CpuStreams()
        return _STREAMS

    def collective_device(self, device: torch.device, group: Optional[dist.ProcessGroup]) -> torch.device:
        """The device on which a collective over ``group`` (None: the default group) moves the
        data of a tensor on ``device``: ``device`` itself where a backend of the group serves
        its type (``cpu:gloo,cuda:nccl`` serves both), else this rank's accelerator, for a host
        tensor over an NCCL / HCCL group (e.g. CPU-offloaded parameters): the caller copies it
        there and back, as gradient-norm clipping does.

        Raises:
            ValueError: no backend of the group serves ``device`` or this rank's device.
        """
        config = str(dist.get_backend_config(group))
        served = {entry.split(":", 1)[0] for entry in config.split(",")}
        if device.type in served:
            return device
        if self.device_type in served:
            return self.current_device()
        raise ValueError(f"a tensor on {device} cannot take part in a collective over a process group "
                         f"whose backends are {config!r} (this rank's device: {self.current_device()})")

    def pin_memory_available(self) -> bool:
        return self.is_accelerator

    def pinned_host_buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory (uint8) that the accelerator copies to and from without the
        host waiting, and whose pages go back to the system when its last reference is dropped.

        CUDA: whole pages of a plain CPU tensor that belong to this buffer alone, page-locked
        with ``cudaHostRegister`` and unregistered when its storage is freed (DCP's stager does
        the same). The tensor is over-allocated by a page and the buffer is its page-aligned
        part, so two small buffers never share a page (registering a page twice fails). Memory
        from ``pin_memory=True`` belongs to torch's caching host allocator instead and stays
        locked until :meth:`empty_host_cache`; a registration that fails falls back to it, with
        a warning (:meth:`pinned_memory_cached` is then True). Other accelerators:
        ``pin_memory=True`` (their caching allocator). CPU: plain memory.
        """
        if not self.pin_memory_available():
            return torch.empty(nbytes, dtype=torch.uint8)
        if self.device_type != "cuda":
            return self.cached_pinned_buffer(nbytes)
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        span = -(-nbytes // _PAGE) * _PAGE
        raw = torch.empty(span + _PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % _PAGE
        address = raw.data_ptr() + start
        try:
            self.host_register(address, span)
        except RuntimeError as exc:
            _note_cached_pinning()
            warnings.warn(f"{exc}; using pinned memory of torch's caching host allocator instead "
                          f"(kept until the host cache is emptied)", RuntimeWarning, stacklevel=2)
            return self.cached_pinned_buffer(nbytes)
        # Unregistered once nothing (no view) holds the storage; not at exit, when the CUDA
        # context may already be gone.
        weakref.finalize(raw.untyped_storage(), self.host_unregister, address).atexit = False
        return raw[start:start + nbytes]

    def cached_pinned_buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of pinned host memory from the accelerator's caching host allocator
        (``pin_memory=True``): kept by that cache once dropped, until :meth:`empty_host_cache`."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def pinned_memory_cached(self) -> bool:
        """Whether buffers of :meth:`pinned_host_buffer` may stay with the caching host
        allocator once dropped: on accelerators other than CUDA, and on CUDA once a
        registration fell back to it. Whoever drops such buffers for good calls
        :meth:`empty_host_cache` (``StagingBuffers.release``)."""
        return self.is_accelerator and (self.device_type != "cuda" or _CACHED_PINNING)

    def empty_host_cache(self) -> None:
        """Give the pinned host memory that the caching host allocator holds and nothing uses
        back to the system (``torch.accelerator.empty_host_cache``). No-op on CPU."""
        if self.is_accelerator:
            torch.accelerator.empty_host_cache()

    def host_register(self, address: int, nbytes: int) -> None:
        """Page-lock host memory for the accelerator (CUDA: ``cudaHostRegister``, portable).

        Raises:
            RuntimeError: the registration failed (its error is cleared first, so that it does
                not surface at the next kernel launch).
        """
        code = int(self.device_module.cudart().cudaHostRegister(address, nbytes, 1))
        if code != 0:
            _clear_cuda_error()
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with cudaError {code}")

    def host_unregister(self, address: int) -> None:
        """Undo :meth:`host_register` (CUDA: ``cudaHostUnregister``)."""
        code = int(self.device_module.cudart().cudaHostUnregister(address))
        if code != 0:
            _clear_cuda_error()
            raise RuntimeError(f"cudaHostUnregister failed with cudaError {code}")

    def reset_peak_memory(self) -> None:
        if self.is_accelerator:
            self.device_module.reset_peak_memory_stats()

    def peak_memory_bytes(self) -> int:
        """Peak allocated accelerator memory; on CPU, the process's peak RSS."""
        if self.is_accelerator:
            return int(self.device_module.max_memory_allocated())
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_PLATFORM: Optional[Platform] = None
_STREAMS: Optional[Streams] = None
_CACHED_PINNING = False  # a CUDA host registration fell back to the caching host allocator
_PAGE = resource.getpagesize()


def _note_cached_pinning() -> None:
    global _CACHED_PINNING
    _CACHED_PINNING = True


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error of this thread (``cudaGetLastError``). A failed
    runtime call leaves it set, and torch's check after the next kernel launch would raise it
    there. ``torch.cuda.cudart()`` does not bind it: call it in the runtime the process loaded
    (its symbols are global once torch loaded it)."""
    try:
        ctypes.CDLL(None).cudaGetLastError()
    except (AttributeError, OSError):
        for path in _loaded_libraries("libcudart"):
            ctypes.CDLL(path).cudaGetLastError()
            return


def _loaded_libraries(stem: str) -> List[str]:
    """Paths of the shared libraries named ``stem*`` this process has mapped (Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if stem in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(stem))


def get_platform() -> Platform:
    """The platform of this process (detected once, then cached).

    ``HYPER_PARALLEL_DEVICE=cpu|cuda|npu`` forces the choice.
    """
    global _PLATFORM
    if _PLATFORM is None:
        device_type = _detect_device_type()
        _PLATFORM = Platform(device_type=device_type, backend=_BACKENDS[device_type])
    return _PLATFORM


def reset_platform() -> None:
    """Forget the cached platform (tests that change ``HYPER_PARALLEL_DEVICE``)."""
    global _PLATFORM, _STREAMS, _CACHED_PINNING
    _PLATFORM = _STREAMS = None
    _CACHED_PINNING = False


def init_distributed(timeout_s: float = 600.0) -> Platform:
    """Initialise the default process group from torchrun's environment, if not done yet.

    Binds the process to its local accelerator first. Without ``WORLD_SIZE`` in the
    environment (a plain ``python`` run) it starts a single-rank group on loopback.

    Raises:
        RuntimeError: if the environment names a rank outside the world size.
    """
    platform = get_platform()
    if dist.is_initialized():
        return platform
    platform.set_device()
    if "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 0 <= rank < world:
        raise RuntimeError(f"RANK={rank} is outside WORLD_SIZE={world}")
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=platform.backend,
        store=_per_attempt_agent_store(world, timeout),
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=platform.current_device() if platform.is_accelerator else None,
    )
    return platform


def _per_attempt_agent_store(world: int, timeout: datetime.timedelta) -> Optional[dist.Store]:
    """torchrun's shared rendezvous store, namespaced by restart attempt; None outside torchrun.

    torchrun lets the workers reuse its rendezvous TCPStore and keeps that store across
    ``--max-restarts`` restarts without a per-attempt prefix, so a restarted group would read
    the previous attempt's keys (gloo then tries to connect to dead peers).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=False, timeout=timeout,
    )
    return dist.PrefixStore(f"hyper_parallel/attempt{attempt}", agent_store)


def free_port() -> int:
    """A TCP port on loopback that is free right now (for rendezvous on one machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
