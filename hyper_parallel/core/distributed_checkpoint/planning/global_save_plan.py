"""The coordinator's step of save planning: merge every rank's local plan into the checkpoint's
metadata, refusing two writers of one item and tensors whose chunks do not cover them, in
one pass over the items (linear in the number of chunks)."""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Sequence, Tuple

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMetadata,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, WriteItem, WriteItemType



def build_global_save_plan(all_plans: List[SavePlan], check_coverage: bool = True
                           ) -> Tuple[List[SavePlan], Metadata]:
    """Every rank's plan with the items another rank already writes dropped, and the metadata of
    the checkpoint they write (chunks sorted by offset; no storage locations yet).

    A plain value held by several ranks is written by the lowest one. With ``check_coverage``
    (a global save) every tensor's chunks must add up to its size.

    Raises:
        CheckpointError: two ranks plan to write one chunk, ranks disagree on a tensor's dtype,
            size or kind, or (``check_coverage``) a tensor's chunks do not cover it.
    """
    state_md: Dict[str, StorageMetadata] = {}
    layouts: Dict[str, Dict] = {}
    seen: Dict[MetadataIndex, int] = {}
    plans = []
    for rank, plan in enumerate(all_plans):
        layouts.update(plan.layouts)
        kept = []
        for item in plan.items:
            known = len(seen)
            writer = seen.setdefault(item.index, rank)
            if len(seen) == known:
                if item.index.fqn in plan.value_checksums:
                    continue  # a plain value: the lowest rank holding it writes it
                raise CheckpointError(f"ranks {writer} and {rank} both planned to write {item.index}")
            kept.append(item)
            _add_to_metadata(state_md, item)
        plans.append(dataclasses.replace(plan, items=kept))
    for fqn, md in state_md.items():
        if isinstance(md, TensorStorageMetadata):
            md.chunks.sort()
            covered = sum(math.prod(md.chunks.sizes_of(i)) for i in range(len(md.chunks)))
            if check_coverage and math.prod(md.size) and covered != math.prod(md.size):
                raise CheckpointError(
                    f"the saved chunks of {fqn!r} cover {covered} of {math.prod(md.size)} elements; "
                    "ranks hold inconsistent layouts of this tensor"
                )
    return plans, Metadata(state_dict_metadata=state_md, layouts=layouts, world_size=len(all_plans))


def _add_to_metadata(state_md: Dict[str, StorageMetadata], item: WriteItem) -> None:
    fqn = item.index.fqn
    md = state_md.get(fqn)
    if item.type == WriteItemType.BYTE_IO:
        if md is None:
            state_md[fqn] = BytesStorageMetadata()
        elif not isinstance(md, BytesStorageMetadata):
            raise CheckpointError(f"{fqn!r} is a tensor on one rank and a plain value on another")
        return
    td = item.tensor_data
    if md is None:
        md = state_md[fqn] = TensorStorageMetadata(td.dtype, td.size)
    elif not isinstance(md, TensorStorageMetadata):
        raise CheckpointError(f"{fqn!r} is a tensor on one rank and a plain value on another")
    elif (md.dtype, md.size) != (td.dtype, td.size):
        raise CheckpointError(f"ranks disagree on tensor {fqn!r}: dtype {md.dtype} size {md.size} "
                              f"vs dtype {td.dtype} size {td.size}")
    if item.index.index is None:
        md.chunks.append_box(td.chunk.offsets, td.chunk.sizes)


def check_values_agree(checksums: Sequence[Dict[str, int]]) -> None:
    """Refuse plain tensors/values whose key holds different values on different ranks.

    ``checksums[r]`` is rank r's ``SavePlan.value_checksums``. Raises:
        CheckpointError: naming the key and two ranks that disagree.
    """
    first: Dict[str, Tuple[int, int]] = {}
    for rank, values in enumerate(checksums):
        for key, crc in values.items():
            holder, reference = first.setdefault(key, (rank, crc))
            if reference != crc:
                raise CheckpointError(
                    f"plain value {key!r} differs between rank {holder} and rank {rank}; a plain "
                    "tensor or value is one value for the whole job: make it a DTensor or store "
                    f"per-rank values under rank-specific keys (e.g. '{key}.rank{rank}')"
                )
