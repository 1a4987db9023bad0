"""Distributed checkpointing: sharded save/load of DTensor state dicts on safetensors.

Save and load with any mesh shape, world size and placement; checkpoints are committed
atomically and can be verified against per-file and per-chunk checksums. See
``docs/checkpoint.md``. Import the names below from ``hyper_parallel.checkpoint`` (this module):
they are the public API; the modules under it are internal.

Map of the package, top down: each row imports only the rows below it, and names in one row
never import each other (``tests/checkpoint/test_layers.py`` checks this from the imports; see
``docs/checkpoint.md``, "Code layout")::

    cli.py            ``python -m hyper_parallel.checkpoint``
    manager.py        CheckpointManager: step-N folders, retention, resume (through the folder's store)
    hf.py             Hugging Face export/load
    optimizer_state_dict.py  optimizer state dicts by FQN (OptimizerState)
    state_dict.py     model state dicts by FQN (ModelState), the options both halves share
    api.py            save, async_save, load, is_checkpoint, read_checkpoint_metadata,
                      verify_checkpoint: the planner and storage steps in order across ranks
    dcp_interop/      torch DCP / torchtitan checkpoints: reader, import-dcp, export-dcp
    stores.py         store_for(checkpoint_id): the one place a checkpoint id picks its backend
    filesystem/       the file system backend: LocalStore (folder), FileSystemWriter (writer),
    object_store/     FileSystemReader (reader), data_files (local files), commit (pending
                      directory, markers, committed metadata), block_reads, folder_lock (flock);
                      the object store backend: ObjectStore (folder), FsspecWriter, FsspecReader
                      (fsspec URLs: s3://, memory://, file://), store (its commit protocol: data
                      objects tagged by save id, metadata last), forwarding (chunks fetched once,
                      sent between ranks), lease (one job per folder), conditional (conditional
                      requests). Neither imports the other.
    planning/         save_planner, load_planner (per rank), global_save_plan (coordinator),
                      plan_cache (repeated saves), verify_plan (who checks which chunk on load;
                      the readers' shared base), shards (which box a rank holds), collectives
    host_memory/      staging_buffers (the process's pool of host memory, ``staging_buffers()``),
                      snapshot (a save's copy stages), bounce (loads' boxes through the pool),
                      background (async saves' thread and Future)
    encoding/         a save's bytes, whatever stores them: data_files (a rank's files,
                      safetensors streaming, values files), results (write results as JSON)
    storage.py        contracts: StorageWriter, AsyncCommitWriter, StorageReader, ChunkSource
                      (a writer's input), CheckpointStore (a backend)
    planner.py        contracts: write/read items and plans, SavePlanner, LoadPlanner
    stateful.py       the Stateful protocol
    format/           metadata (+ chunk_table, storage_table), safetensors_format, values,
                      checksum, validation, geometry (boxes), flatten: no process group
    _fileio.py        file operations (hyper_parallel.utils.fileio's, refusals as CheckpointError)
    errors.py         CheckpointError

Save: ``api.save`` -> ``planning/plan_cache`` (``save_planner`` on each rank,
``global_save_plan`` on the coordinator, through ``collectives``) -> ``host_memory/snapshot``
copies chunks into the staging buffers -> the store's writer (``filesystem/writer``) writes
``encoding/data_files`` into the pending directory -> ``filesystem/commit`` writes
``metadata.json`` last and swaps it into place. An async save runs the write (and with
``stage_in_background`` the snapshot) on ``host_memory/background``.

Load: ``api.load`` -> the store's reader (``filesystem/reader``) reads ``metadata.json``
(``filesystem/commit``, checked by ``format/validation``) -> ``planning/load_planner`` maps
stored chunks onto this rank's tensors, ``planning/verify_plan`` assigns checksum duties -> the
reader fills them through ``filesystem/block_reads`` (whole chunks) and ``host_memory/bounce``
(boxes, device memory; through the staging buffers).

May import (beside torch and safetensors): ``core.layout``, ``_torch_compat``, ``_optional``, ``platform``
and ``utils``; never
``fully_shard``, ``parallel``, ``models``, ``trainer`` or ``data``.
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
    CheckpointStore,
    ChunkSource,
    RankWriteResult,
    StorageReader,
    StorageWriter,
    WriteResult,
    checkpoint_step,
)
from hyper_parallel.core.distributed_checkpoint.filesystem.folder import LocalStore
from hyper_parallel.core.distributed_checkpoint.object_store.folder import ObjectStore
from hyper_parallel.core.distributed_checkpoint.stores import startup_bounds, store_for

__all__ = [
    "save", "async_save", "load", "wait_for_pending_save", "staging_buffers",
    "FileSystemReader", "FileSystemWriter", "FsspecReader", "FsspecWriter", "is_checkpoint", "read_checkpoint_metadata",
    "verify_checkpoint", "flatten_state_dict",
    "BytesStorageMetadata", "CheckpointError", "ChunkStorageMetadata", "FileInfo", "Metadata",
    "MetadataIndex", "StorageInfo", "TensorStorageMetadata",
    "LoadItemType", "LoadPlan", "LoadPlanner", "ReadItem", "SavePlan", "SavePlanner",
    "StandardLoadPlanner", "StandardSavePlanner", "WriteItem", "WriteItemType",
    "RankWriteResult", "StorageReader", "StorageWriter", "WriteResult", "AsyncCommitWriter", "ChunkSource", "Stateful",
    "AsyncSaveFuture", "CheckpointStore", "LocalStore", "ObjectStore", "store_for", "startup_bounds", "checkpoint_step",
]

# --- state dict helpers, CheckpointManager and HF interop (state_dict.py, optimizer_state_dict.py, manager.py, hf.py) ---
from hyper_parallel.core.distributed_checkpoint.hf import DEFAULT_MAX_SHARD_BYTES, export_hf, load_hf
from hyper_parallel.core.distributed_checkpoint.filesystem.folder_lock import LOCK_FILE
from hyper_parallel.core.distributed_checkpoint.manager import CheckpointManager, committed_steps, resolve_checkpoint
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
from hyper_parallel.core.distributed_checkpoint.cli import main as cli_main

__all__ += [
    "DcpReader", "export_dcp", "import_dcp", "cli_main",
    "export_hf", "load_hf", "DEFAULT_MAX_SHARD_BYTES", "CheckpointManager", "LOCK_FILE", "committed_steps",
    "resolve_checkpoint", "ModelState", "OptimizerState", "StateDictOptions",
    "get_model_state_dict", "get_optimizer_state_dict", "set_model_state_dict", "set_optimizer_state_dict",
]
