"""``Metadata.storage_data`` is a column table that answers exactly what a dict answers.

Random sequences of writes and lookups (tensor chunks of 0-3 dims, values, replica indices,
unknown names, overwrites) run against a :class:`StorageTable` and a dict side by side; the
table must also survive pickling (how the coordinator sends metadata to every rank) and a
metadata JSON round trip bit-exact, and hold a location in far less memory than the
``MetadataIndex`` + ``StorageInfo`` objects it stands for.
"""

import pickle
import random
import tracemalloc

import pytest
import torch

import hyper_parallel.checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.format import storage_table
from hyper_parallel.core.distributed_checkpoint.format.storage_table import StorageTable

FQNS = ("model.w", "model.v", "optim.state.w.exp_avg", "train.step")


def _random_index(rng: random.Random, fqns=FQNS) -> hdcp.MetadataIndex:
    ndim = rng.choice([None, 0, 1, 2, 2, 3])
    offset = None if ndim is None else tuple(rng.randint(0, 5) for _ in range(ndim))
    return hdcp.MetadataIndex(rng.choice(fqns), offset, rng.choice([None, None, None, 1, 2]))


def _random_info(rng: random.Random) -> hdcp.StorageInfo:
    return hdcp.StorageInfo(rng.choice(["__0_0.safetensors", "__1_0.safetensors", "__0.values.json"]),
                            rng.randint(0, 2**40), rng.randint(0, 2**20), rng.randint(0, 2**32 - 1),
                            rng.choice(["raw", "json", "pickle"]))


def _same(table: StorageTable, reference: dict) -> None:
    assert len(table) == len(reference)
    assert list(table.items()) == list(reference.items())  # insertion order, as a dict keeps it
    assert list(table) == list(reference) and list(table.values()) == list(reference.values())
    assert table == reference


def test_matches_a_dict_under_random_writes_and_lookups():
    for seed in range(20):
        rng = random.Random(seed)
        table, reference = StorageTable(), {}
        for _ in range(rng.choice([10, 300, 3000])):
            index, info = _random_index(rng), _random_info(rng)
            action = rng.random()
            if action < 0.5:
                table[index] = info
                reference[index] = info
            elif action < 0.75:
                assert table.setdefault(index, info) == reference.setdefault(index, info)
            else:
                fields = (index.fqn, index.offset, index.index, info.relative_path, info.offset,
                          info.length, info.checksum, info.encoding)
                assert table.insert(*fields) == (index not in reference)
                reference.setdefault(index, info)
            query = _random_index(rng, FQNS + ("not.stored",))
            assert (query in table) == (query in reference)
            assert table.get(query) == reference.get(query)
            if query in reference:
                assert table[query] == reference[query]
            else:
                with pytest.raises(KeyError):
                    table[query]
        _same(table, reference)
        received = pickle.loads(pickle.dumps(table))
        _same(received, reference)
        for index in reference:  # lookups through the rebuilt hash index
            assert received[index] == reference[index]
        received[hdcp.MetadataIndex("model.new", (0,))] = _random_info(rng)  # still writable
        assert len(received) == len(reference) + 1


def test_none_and_empty_offsets_and_bad_keys():
    table = StorageTable()
    info = hdcp.StorageInfo("f", 0, 4, 7)
    table[hdcp.MetadataIndex("x")] = info  # a value: offset None
    assert hdcp.MetadataIndex("x", ()) not in table  # a 0-dim chunk is another key
    table[hdcp.MetadataIndex("x", ())] = info
    assert len(table) == 2
    assert hdcp.MetadataIndex("x", None, 1) not in table and "x" not in table and None not in table
    assert hdcp.MetadataIndex("x", None, -1) not in table
    with pytest.raises(ValueError, match="negative"):
        table[hdcp.MetadataIndex("x", None, -1)] = info


def test_received_table_rehashes_when_the_interpreter_hashes_differently(monkeypatch):
    rng = random.Random(1)
    reference = {_random_index(rng): _random_info(rng) for _ in range(500)}
    sent = pickle.dumps(StorageTable(reference))
    monkeypatch.setattr(storage_table, "_PROBE", (7, 7))  # as if the sender's hash of it differed
    received = pickle.loads(sent)
    _same(received, reference)
    assert all(received[index] == info for index, info in reference.items())


def _layout_metadata(rng: random.Random, chunks_per_tensor: int) -> hdcp.Metadata:
    """Metadata of a random 1-D/2-D sharded state with one storage location per chunk and a
    few values, as a save records them (rank by rank)."""
    state, storage, files = {}, {}, {}
    for t in range(4):
        rows = rng.randint(chunks_per_tensor, 4 * chunks_per_tensor)
        cols = rng.choice([None, rng.randint(1, 9)])
        cuts = sorted(rng.sample(range(1, rows), chunks_per_tensor - 1)) if chunks_per_tensor > 1 else []
        bounds = [0, *cuts, rows]
        size = (rows,) if cols is None else (rows, cols)
        chunks = [hdcp.ChunkStorageMetadata((a,) + (0,) * (len(size) - 1), (b - a,) + size[1:])
                  for a, b in zip(bounds, bounds[1:])]
        state[f"model.t{t}"] = hdcp.TensorStorageMetadata(torch.float32, size, chunks)
        for rank, chunk in enumerate(chunks):
            name = f"__{rank}_0.safetensors"
            at = files.get(name, 8)
            length = 4 * chunk.sizes[0] * (cols or 1)
            storage[hdcp.MetadataIndex(f"model.t{t}", chunk.offsets)] = hdcp.StorageInfo(
                name, at, length, rng.randint(0, 2**32 - 1))
            files[name] = at + length
    for key in ("train.step", "train.lr"):
        state[key] = hdcp.BytesStorageMetadata()
        storage[hdcp.MetadataIndex(key)] = hdcp.StorageInfo("__0.values.json", rng.randint(0, 99), 3, 5, "json")
    files["__0.values.json"] = 200
    return hdcp.Metadata(state, storage, {n: hdcp.FileInfo(s, rng.randint(0, 2**32 - 1)) for n, s in files.items()},
                         world_size=chunks_per_tensor, save_id="abc")


def test_metadata_round_trips_bit_exact():
    for seed in range(5):
        metadata = _layout_metadata(random.Random(seed), chunks_per_tensor=random.Random(seed).randint(1, 40))
        assert isinstance(metadata.storage_data, StorageTable)
        text = metadata.to_json()
        parsed = hdcp.Metadata.from_json(text)
        assert parsed == metadata and parsed.to_json() == text
        received = pickle.loads(pickle.dumps(parsed))
        assert received == metadata and received.to_json() == text


def test_parsed_locations_are_held_compactly():
    """A rank holds a chunk's storage location in under 128 bytes, its hash index and names
    included (FSDP over 4,096 ranks: one location per chunk, one file per rank); as one
    MetadataIndex + StorageInfo pair in a dict it took over 300."""
    metadata = _layout_metadata(random.Random(0), chunks_per_tensor=4096)
    sent = pickle.dumps(hdcp.Metadata.from_json(metadata.to_json()).storage_data)
    tracemalloc.start()
    received = pickle.loads(sent)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert received == metadata.storage_data
    assert held < 128 * len(received), f"{held / len(received):.0f} bytes per location"
