"""Distributed checkpointing: sharded save/load of DTensor state dicts on safetensors.

Save and load with any mesh shape, world size and placement; checkpoints are committed
atomically and can be verified against per-file and per-chunk checksums. See
``docs/checkpoint.md``.

Map of the package (each layer imports only the layers below it; see ``docs/checkpoint.md``,
"Code layout")::

    api.py            save, async_save, load: the planner and storage steps in order across ranks
    manager.py        CheckpointManager: step-N folders, retention, resume
    state_dict.py     model state dicts by FQN (ModelState), the options both halves share
    optimizer_state_dict.py  optimizer state dicts by FQN (OptimizerState)
    stateful.py       the Stateful protocol
    hf.py, cli.py     Hugging Face export/load; ``python -m hyper_parallel.checkpoint``
    dcp_interop/      torch DCP / torchtitan checkpoints: reader, import-dcp, export-dcp
    planner.py        contract: write/read items and plans, SavePlanner, LoadPlanner
    storage.py        contract: StorageWriter, StorageReader, ChunkSource (a writer's input)
    errors.py         CheckpointError
    _fileio.py        file operations (hyper_parallel.utils.fileio's, refusals as CheckpointError)
    planning/         save_planner, load_planner (per rank), global_save_plan (coordinator),
                      plan_cache (repeated saves), verify_plan (who checks which chunk on load),
                      shards (which box a rank holds), collectives (coordinator steps)
    host_memory/      slabs (the process's pool, ``staging_buffers()``), snapshot (a save's host
                      copy through the slabs), background (async saves' thread and Future)
    filesystem/       writer, reader, data_files (safetensors + values files), commit (pending
                      directory, markers, committed metadata), block_reads, bounce (load reads),
                      folder_lock (a manager folder's flock)
    object_store/     FsspecWriter, FsspecReader (fsspec URLs: s3://, memory://, file://), store
                      (the commit protocol there: data objects tagged by save id, metadata last),
                      forwarding (chunks fetched once, sent between ranks), folder (a manager
                      folder), lease (one job per folder), conditional (conditional requests)
    format/           metadata (+ chunk_table, storage_table), safetensors_format, values,
                      checksum, validation, geometry (boxes), flatten: no process group, no threads

Save: ``api.save`` -> ``planning/plan_cache`` (``save_planner`` on each rank,
``global_save_plan`` on the coordinator, through ``collectives``) -> ``host_memory/snapshot``
copies chunks into ``slabs`` -> ``filesystem/writer`` writes ``data_files`` into the pending
directory -> ``filesystem/commit`` writes ``metadata.json`` last and swaps it into place. An
async save runs the write (and with ``stage_in_background`` the snapshot) on
``host_memory/background``.

Load: ``api.load`` -> ``filesystem/reader`` reads ``metadata.json`` (``filesystem/commit``,
checked by ``format/validation``) -> ``planning/load_planner`` maps stored chunks onto this
rank's tensors, ``planning/verify_plan`` assigns checksum duties -> the reader fills them
through ``filesystem/block_reads`` (whole chunks) and ``filesystem/bounce`` (boxes, device
memory; through the ``host_memory/slabs``).
"""

from hyper_parallel.core.distributed_checkpoint.api import (
    async_save,
    is_checkpoint,
    load,
    read_checkpoint_metadata,
    save,
    staging_buffers,
    verify_checkpoint,
    wait_for_pending_save,
)
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.host_memory.background import AsyncSaveFuture
from hyper_parallel.core.distributed_checkpoint.filesystem.reader import FileSystemReader
from hyper_parallel.core.distributed_checkpoint.filesystem.writer import FileSystemWriter
from hyper_parallel.core.distributed_checkpoint.format.flatten import flatten_state_dict
from hyper_parallel.core.distributed_checkpoint.object_store.reader import FsspecReader
from hyper_parallel.core.distributed_checkpoint.object_store.writer import FsspecWriter
from hyper_parallel.core.distributed_checkpoint.format.metadata import (
    BytesStorageMetadata,
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
from hyper_parallel.core.distributed_checkpoint.planning.load_planner import StandardLoadPlanner
from hyper_parallel.core.distributed_checkpoint.planning.save_planner import StandardSavePlanner
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
    "FileSystemReader", "FileSystemWriter", "FsspecReader", "FsspecWriter", "is_checkpoint", "read_checkpoint_metadata",
    "verify_checkpoint", "flatten_state_dict",
    "BytesStorageMetadata", "CheckpointError", "ChunkStorageMetadata", "FileInfo", "Metadata",
    "MetadataIndex", "StorageInfo", "TensorStorageMetadata",
    "LoadItemType", "LoadPlan", "LoadPlanner", "ReadItem", "SavePlan", "SavePlanner",
    "StandardLoadPlanner", "StandardSavePlanner", "WriteItem", "WriteItemType",
    "RankWriteResult", "StorageReader", "StorageWriter", "WriteResult", "AsyncCommitWriter", "Stateful",
    "AsyncSaveFuture",
]

# --- state dict helpers, CheckpointManager and HF interop (state_dict.py, optimizer_state_dict.py, manager.py, hf.py) ---
from hyper_parallel.core.distributed_checkpoint.hf import export_hf, load_hf
from hyper_parallel.core.distributed_checkpoint.manager import CheckpointManager
from hyper_parallel.core.distributed_checkpoint.optimizer_state_dict import (
    OptimizerState,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from hyper_parallel.core.distributed_checkpoint.state_dict import (
    ModelState,
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from hyper_parallel.core.distributed_checkpoint.dcp_interop import DcpReader, export_dcp, import_dcp

__all__ += [
    "DcpReader", "export_dcp", "import_dcp",
    "export_hf", "load_hf", "CheckpointManager", "ModelState", "OptimizerState", "StateDictOptions",
    "get_model_state_dict", "get_optimizer_state_dict", "set_model_state_dict", "set_optimizer_state_dict",
]
