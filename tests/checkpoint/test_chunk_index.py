"""The chunk table's offset index answers exactly what a scan of every chunk answers.

Random tilings (uneven, with empty pieces, 1-3 dims, cut on one or several dims) are queried
through :class:`ChunkTable` and by brute force; then the load planner, which uses the index,
is compared with a brute-force plan for DTensor layouts saved and loaded across FSDP, HSDP,
``Shard(1)``, 2-D and replicated placements (torch's ``fake`` process group, meta tensors).
"""

import math
import pickle
import random
import tracemalloc

import pytest
import torch

import hyper_parallel.checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.format.chunk_table import ChunkTable
from hyper_parallel.core.distributed_checkpoint.format.geometry import overlap
from hyper_parallel.core.distributed_checkpoint.planning.shards import local_chunk
from tests.checkpoint.helpers import META_LAYOUTS, META_SHAPES, meta_state


def _cuts(rng: random.Random, length: int, pieces: int):
    """Uneven [start, size) pieces covering ``range(length)``; some may be empty."""
    points = sorted(rng.randint(0, length) for _ in range(pieces - 1))
    bounds = [0, *points, length]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def _grid(rng: random.Random, shape):
    """A random tiling of ``shape``: a grid cut on a random subset of dims, in random order."""
    per_dim = [_cuts(rng, n, rng.choice([1, 1, 2, 3, 7])) for n in shape]
    boxes = [((), ())]
    for pieces in per_dim:
        boxes = [(o + (start,), s + (size,)) for o, s in boxes for start, size in pieces]
    rng.shuffle(boxes)
    return [hdcp.ChunkStorageMetadata(o, s) for o, s in boxes]


def _random_box(rng: random.Random, shape):
    offsets = tuple(rng.randint(0, n) for n in shape)
    return hdcp.ChunkStorageMetadata(offsets, tuple(rng.randint(0, n - o) for n, o in zip(shape, offsets)))


def test_overlapping_and_lookup_match_a_scan():
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3)))
        chunks = _grid(rng, shape)
        table = ChunkTable(len(shape), chunks)
        assert list(table) == chunks and table == chunks and len(table) == len(chunks)
        assert pickle.loads(pickle.dumps(table)) == table
        queries = _grid(rng, shape) + [_random_box(rng, shape) for _ in range(10)]
        for box in queries:
            expected = [i for i, c in enumerate(chunks) if overlap(box, c) is not None]
            assert table.overlapping(box.offsets, box.sizes) == expected, (shape, chunks, box)
            first = next((c.sizes for c in chunks if c.offsets == box.offsets), None)
            assert table.sizes_at(box.offsets) == first
        table.sort()
        assert list(table) == sorted(chunks, key=lambda c: c.offsets)


def test_scalar_and_empty_tables():
    scalar = ChunkTable(0, [hdcp.ChunkStorageMetadata((), ())])
    assert scalar.overlapping((), ()) == [0] and scalar.sizes_at(()) == ()
    empty = ChunkTable(1, [hdcp.ChunkStorageMetadata((0,), (0,))])  # a zero-element tensor
    assert empty.sizes_at((0,)) == (0,) and empty.overlapping((0,), (0,)) == []
    with pytest.raises(ValueError, match="2-dim tensor"):
        ChunkTable(2).append_box((0,), (3,))


def test_parsed_metadata_holds_chunks_compactly():
    """A tensor's chunks parse into one table, not one object per chunk (FSDP over 4,096 ranks:
    4,096 chunks of a (8192, 64) tensor); a list of chunks still compares equal."""
    chunks = [hdcp.ChunkStorageMetadata((2 * i, 0), (2, 64)) for i in range(4096)]
    text = hdcp.Metadata({"w": hdcp.TensorStorageMetadata(torch.bfloat16, (8192, 64), chunks)}).to_json()
    tracemalloc.start()
    parsed = hdcp.Metadata.from_json(text)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    table = parsed.state_dict_metadata["w"].chunks
    assert isinstance(table, ChunkTable) and table == chunks
    assert held < 48 * len(chunks), f"{held / len(chunks):.0f} bytes per parsed chunk"


# ---------------------------------------------------------------- the load planner on DTensors

def _brute_force_reads(state, metadata):
    reads = []
    for key in sorted(state):
        dest = local_chunk(state[key])
        for stored in metadata.state_dict_metadata[key].chunks:
            common = overlap(dest, stored)
            if common is not None:
                reads.append(hdcp.ReadItem(hdcp.LoadItemType.TENSOR, hdcp.MetadataIndex(key, dest.offsets),
                                           common[0], hdcp.MetadataIndex(key, stored.offsets), *common[1:]))
    return reads


@pytest.mark.parametrize("saved,loaded", [
    ("fsdp", "hsdp"), ("hsdp", "fsdp_large"), ("fsdp_large", "shard1"), ("shard1", "2d"),
    ("2d", "2d_swapped"), ("2d_swapped", "fsdp"), ("replicated", "2d"), ("2d", "replicated"),
])
def test_load_plan_matches_a_scan_of_every_chunk(fake_process_group, saved, loaded):
    plans = []
    for rank in range(math.prod(META_LAYOUTS[saved][0])):
        state = meta_state(saved, rank)
        planner = hdcp.StandardSavePlanner()
        planner.configure_planner(state, rank=rank)
        plans.append(planner.build_local_plan())
    coordinator = hdcp.StandardSavePlanner()
    coordinator.configure_planner({}, rank=0)
    _, metadata = coordinator.build_global_plan(plans)
    metadata = hdcp.Metadata.from_json(metadata.to_json())
    reads = 0
    for rank in range(math.prod(META_LAYOUTS[loaded][0])):
        state = meta_state(loaded, rank)
        planner = hdcp.StandardLoadPlanner()
        planner.configure_planner(state, metadata, rank=rank, use_collectives=False)
        expected = _brute_force_reads(state, metadata)
        assert planner.build_local_plan().items == expected, (saved, loaded, rank)
        reads += len(expected)
    assert reads >= len(META_SHAPES)
