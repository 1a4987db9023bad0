"""``import_dcp`` (torch DCP -> ours) and ``export_dcp`` (ours -> torch DCP), both run in a
plain process (no process group) and both stream one stored chunk at a time.

import: each DCP chunk becomes one chunk of ours (same global offsets; a chunk of a split
fused tensor one chunk of each part), read when the writer asks for it and written before the
next is read, so host memory holds about one chunk (at most the largest tensor), never the
checkpoint. Values are read at planning time (they are small) and stored as JSON. What is
written under which name: :mod:`key_mapping`.

export: torch's own ``FileSystemWriter`` writes the DCP checkpoint (so torch reads it back
by construction); its planner asks for each tensor when it writes it, and the tensor is then
loaded whole from our checkpoint: memory is about the largest tensor.
"""

from __future__ import annotations

import math
import os
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint import FileSystemWriter as TorchFileSystemWriter
from torch.distributed.checkpoint import save as torch_dcp_save
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from hyper_parallel._torch_compat import dcp_fsspec_storage
from hyper_parallel.core.distributed_checkpoint._fileio import url_scheme
from hyper_parallel.core.distributed_checkpoint.dcp_interop.destination import OutputKind, check_destination, staged_output
from hyper_parallel.core.distributed_checkpoint.dcp_interop.fused_split import FusedSplit, part_chunks, part_sizes
from hyper_parallel.core.distributed_checkpoint.dcp_interop.key_mapping import (
    Made,
    Rule,
    Source,
    SplitRows,
    map_keys,
    plan_import,
)
from hyper_parallel.core.distributed_checkpoint.dcp_interop.reader import DcpFiles, translate_metadata
from hyper_parallel.core.distributed_checkpoint.dcp_interop.rotary_layout import RotateHalf
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.planning.global_save_plan import build_global_save_plan
from hyper_parallel.core.distributed_checkpoint.planning.load_planner import StandardLoadPlanner
from hyper_parallel.core.distributed_checkpoint.format.metadata import (
    DTYPE_TO_SAFETENSORS,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.format.values import encode_value
from hyper_parallel.core.distributed_checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from hyper_parallel.core.distributed_checkpoint.storage import StorageReader
from hyper_parallel.core.distributed_checkpoint.stores import store_for

__all__ = ["export_dcp", "import_dcp", "map_keys"]


def _stored_key(source: Source) -> str:
    return "" if isinstance(source, Made) else source.key


class _DcpImportPlanner(SavePlanner):
    """Plans the writes of a DCP checkpoint's items under their new names (what each is made
    of: :func:`plan_import` with ``mapping``, its keyword arguments) and serves each chunk from
    the DCP files when the writer asks for it."""

    def __init__(self, src: str, metadata: Metadata, mapping: Dict[str, Any]) -> None:
        self.src, self.metadata, self.mapping = src, metadata, mapping
        self.sources: Dict[str, Source] = {}
        self._values: Dict[str, bytes] = {}
        # per written chunk: the stored DCP chunk it is read from, and the rows it takes of it (None: all)
        self._reads: Dict[MetadataIndex, Tuple[MetadataIndex, Optional[Tuple[Tuple[int, int], ...]]]] = {}
        self._files = DcpFiles(src, metadata)
        self._last: Tuple[Optional[MetadataIndex], Any] = (None, None)

    def configure_planner(self, state_dict: Dict[str, Any], **kwargs: Any) -> None:
        """The state comes from the DCP checkpoint, not from ``state_dict``."""

    def _read(self, index: MetadataIndex) -> Any:
        """A stored item; the last chunk read is kept, as the parts of a split read it in turn."""
        if self._last[0] != index:
            self._last = (None, None)
            self._last = (index, self._files.read(index))
        return self._last[1]

    def _value_item(self, new: str, value: Any) -> WriteItem:
        self._values[new], encoding = encode_value(value, new, allow_pickle=False)
        return WriteItem(MetadataIndex(new), WriteItemType.BYTE_IO,
                         bytes_io_data=BytesIOWriteData(len(self._values[new]), encoding))

    def _tensor_items(self, new: str, source: Source) -> List[WriteItem]:
        md = self.metadata.state_dict_metadata[source.key]
        if md.dtype not in DTYPE_TO_SAFETENSORS:
            raise CheckpointError(f"DCP tensor {source.key!r} has dtype {md.dtype}, which safetensors cannot store; "
                                  "leave it out (--exclude)")
        stored = [c for c in md.chunks if math.prod(c.sizes)]
        if isinstance(source, SplitRows):
            size = part_sizes(source.rows, md.size)
            pieces = [(p.chunk, p.source_offsets, p.rows) for p in part_chunks(source.rows, stored)]
        else:
            size = tuple(md.size)
            pieces = [(c, c.offsets, None) for c in stored]
        if not math.prod(size):
            pieces = [(ChunkStorageMetadata((0,) * len(size), size), None, None)]
        items = []
        for chunk, offsets, rows in sorted(pieces, key=lambda p: p[0].offsets):
            index = MetadataIndex(new, chunk.offsets)
            self._reads[index] = (MetadataIndex(source.key, offsets), rows)
            items.append(WriteItem(index, WriteItemType.TENSOR, TensorWriteData(chunk, md.dtype, size)))
        return items

    def build_local_plan(self) -> SavePlan:
        self.sources = plan_import(self.metadata, lambda key: self._read(MetadataIndex(key)), **self.mapping)
        if not self.sources:
            raise CheckpointError(f"nothing to import: --exclude leaves none of the {len(self.metadata.state_dict_metadata)} "
                                  f"entries of {self.src}; an empty checkpoint is not written")
        items: List[WriteItem] = []
        # Ordered by the stored item read, so the parts of a split chunk are written one after another.
        for new in sorted(self.sources, key=lambda n: (_stored_key(self.sources[n]), n)):
            source = self.sources[new]
            if isinstance(source, Made):
                items.append(self._value_item(new, source.value))
            elif not isinstance(self.metadata.state_dict_metadata[source.key], TensorStorageMetadata):
                items.append(self._value_item(new, self._read(MetadataIndex(source.key))))
            else:
                items.extend(self._tensor_items(new, source))
        return SavePlan(items)

    def build_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        return build_global_save_plan(all_plans, check_coverage=True)

    def finalize_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def get_data(self, item: WriteItem) -> Any:
        if item.type == WriteItemType.BYTE_IO:
            return self._values[item.index.fqn]
        td = item.tensor_data
        stored, rows = self._reads[item.index]
        if not math.prod(td.size):
            return torch.empty(td.size, dtype=td.dtype)
        chunk = self._read(stored)
        if rows is None:
            return chunk.contiguous()
        return torch.cat([chunk.narrow(0, start, length) for start, length in rows])

    def close(self) -> None:
        self._last = (None, None)
        self._files.close()


def import_dcp(src: str, dst: str, *, rename: Sequence[Rule] = (), exclude: Sequence[str] = (),
               split: Sequence[FusedSplit] = (), rotate_half: Sequence[RotateHalf] = (),
               force: bool = False) -> Metadata:
    """Convert the torch DCP checkpoint ``src`` into a checkpoint of ours at ``dst`` (committed
    atomically), chunk by chunk: host memory stays about one chunk, whatever the checkpoint's
    size. Keys are kept, or mapped by ``exclude``, ``rename`` and ``split``, the rows of the
    tensors ``rotate_half`` names moved from rotated halves to interleaved rotary pairs, and optimizer
    param groups are regrouped into ours (:func:`~.key_mapping.plan_import`). ``src`` and
    ``dst`` may be fsspec URLs. An existing ``dst`` is replaced only if it is a checkpoint of
    ours and ``force`` is given (:func:`~.destination.check_destination`).

    Raises:
        DestinationRefused: ``dst`` is ``src``, or exists and is not empty (see above).
        CheckpointError: ``src`` is not a readable DCP checkpoint, ``exclude`` leaves nothing of
            it (no empty checkpoint is written), refuses a class, holds a
            value that is not plain data or a dtype safetensors cannot store, or a key mapping
            that :func:`~.key_mapping.plan_import` refuses (names the key).
    """
    src, dst = os.fspath(src), os.fspath(dst)
    check_destination(src, dst, OutputKind.OURS, force)
    metadata = translate_metadata(src)
    planner = _DcpImportPlanner(src, metadata, {"rename": rename, "exclude": exclude, "split": split,
                                                      "rotate_half": rotate_half})
    writer = store_for(dst).writer()
    writer.initialize_writer(dst)
    plan = None
    try:
        planner.configure_planner({})
        writer.configure_writer(True, rank=0, world_size=1, use_collectives=True)
        (plan,), ours = planner.build_global_plan([writer.optimize_local_plan(planner.build_local_plan())])
        plan.save_id = ours.save_id = uuid.uuid4().hex
        (plan,) = writer.optimize_global_plan([plan])
        plan = planner.finalize_plan(plan)
        # The writer asks the planner for one chunk at a time (no copy stages reading ahead).
        writer.finalize_checkpoint(ours, [writer.execute_write(plan, planner)])
    except BaseException:
        if plan is not None and plan.save_id:
            writer.abort_checkpoint(plan)
        raise
    finally:
        planner.close()
    return ours


class _LazyExportPlanner(DefaultSavePlanner):
    """torch's planner over meta tensors of our checkpoint's shapes; each tensor is loaded
    from our checkpoint only when torch's writer resolves it."""

    def __init__(self, reader: StorageReader, metadata: Metadata) -> None:
        super().__init__()
        self._reader, self._metadata = reader, metadata

    def resolve_data(self, write_item: Any) -> Any:
        md = self._metadata.state_dict_metadata.get(write_item.index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            return super().resolve_data(write_item)
        tensor = torch.empty(md.size, dtype=md.dtype)
        planner = StandardLoadPlanner()
        planner.configure_planner({write_item.index.fqn: tensor}, self._metadata, use_collectives=False)
        self._reader.execute_read(planner.build_local_plan(), planner)
        return tensor


def export_dcp(src: str, dst: str, *, verify: bool = True, force: bool = False) -> int:
    """Write our checkpoint ``src`` as a torch DCP checkpoint at ``dst`` (flat keys, e.g.
    ``model.layers.0.attention.wq.weight``), readable by ``torch.distributed.checkpoint.load``
    into the same nested state dict; tensors are read one at a time (checked against their
    checksums with ``verify``). Values are written as DCP writes them (``torch.save``'d).
    Returns the number of entries written. ``src`` and ``dst`` may be fsspec URLs; a local
    ``dst`` is written as a staging folder renamed into place (:func:`~.destination.staged_output`),
    an existing one replaced only if it is a DCP checkpoint and ``force`` is given.

    Raises:
        DestinationRefused: ``dst`` is ``src``, or exists and is not empty (see above).
        CheckpointError: ``src`` is not a committed checkpoint, or is corrupt (names the file).
    """
    src, dst = os.fspath(src), os.fspath(dst)
    check_destination(src, dst, OutputKind.DCP, force)
    source = store_for(src)
    metadata = source.read_metadata()
    reader = source.reader(verify=verify)
    reader.initialize_reader(src)
    reader.configure_reader(metadata, True)
    state: Dict[str, Any] = {}
    values = {k: None for k, md in metadata.state_dict_metadata.items() if not isinstance(md, TensorStorageMetadata)}
    if values:
        planner = StandardLoadPlanner()
        planner.configure_planner(values, metadata, use_collectives=False)
        reader.execute_read(planner.build_local_plan(), planner)
        state.update(planner.flat)
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state[fqn] = torch.empty(md.size, dtype=md.dtype, device="meta")
    with staged_output(src, dst, OutputKind.DCP, force) as out:
        writer = dcp_fsspec_storage()[0](out) if url_scheme(out) else TorchFileSystemWriter(out)
        torch_dcp_save(state, storage_writer=writer, planner=_LazyExportPlanner(reader, metadata), no_dist=True)
    return len(state)
