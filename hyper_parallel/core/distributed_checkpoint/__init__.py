"""Distributed checkpointing: sharded save/load of DTensor state dicts on safetensors.

Save and load with any mesh shape, world size and placement; checkpoints are committed
atomically and can be verified against per-file and per-chunk checksums. See
``docs/checkpoint.md``.
"""

from hyper_parallel.core.distributed_checkpoint.api import (
    async_save,
    load,
    save,
    staging_buffers,
    wait_for_pending_save,
)
from hyper_parallel.core.distributed_checkpoint.async_saver import AsyncSaveFuture
from hyper_parallel.core.distributed_checkpoint.commit import is_checkpoint, read_checkpoint_metadata, verify_checkpoint
from hyper_parallel.core.distributed_checkpoint.filesystem import FileSystemReader, FileSystemWriter
from hyper_parallel.core.distributed_checkpoint.flatten import flatten_state_dict
from hyper_parallel.core.distributed_checkpoint.metadata import (
    BytesStorageMetadata,
    CheckpointError,
    ChunkStorageMetadata,
    FileInfo,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from hyper_parallel.core.distributed_checkpoint.load_planner import StandardLoadPlanner
from hyper_parallel.core.distributed_checkpoint.save_planner import StandardSavePlanner
from hyper_parallel.core.distributed_checkpoint.stateful import Stateful
from hyper_parallel.core.distributed_checkpoint.storage import (
    AsyncCommitWriter,
    RankWriteResult,
    StorageReader,
    StorageWriter,
    WriteResult,
)

__all__ = [
    "save", "async_save", "load", "wait_for_pending_save", "staging_buffers",
    "FileSystemReader", "FileSystemWriter", "is_checkpoint", "read_checkpoint_metadata",
    "verify_checkpoint", "flatten_state_dict",
    "BytesStorageMetadata", "CheckpointError", "ChunkStorageMetadata", "FileInfo", "Metadata",
    "MetadataIndex", "StorageInfo", "TensorStorageMetadata",
    "LoadItemType", "LoadPlan", "LoadPlanner", "ReadItem", "SavePlan", "SavePlanner",
    "StandardLoadPlanner", "StandardSavePlanner", "WriteItem", "WriteItemType",
    "RankWriteResult", "StorageReader", "StorageWriter", "WriteResult", "AsyncCommitWriter", "Stateful",
    "AsyncSaveFuture",
]

# --- state dict helpers, CheckpointManager and HF interop (state_dict.py, manager.py, hf.py) ---
from hyper_parallel.core.distributed_checkpoint.hf import export_hf, load_hf
from hyper_parallel.core.distributed_checkpoint.manager import CheckpointManager
from hyper_parallel.core.distributed_checkpoint.state_dict import (
    ModelState,
    OptimizerState,
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hyper_parallel.core.distributed_checkpoint.dcp_interop import DcpReader, export_dcp, import_dcp

__all__ += [
    "DcpReader", "export_dcp", "import_dcp",
    "export_hf", "load_hf", "CheckpointManager", "ModelState", "OptimizerState", "StateDictOptions",
    "get_model_state_dict", "get_optimizer_state_dict", "set_model_state_dict", "set_optimizer_state_dict",
]
