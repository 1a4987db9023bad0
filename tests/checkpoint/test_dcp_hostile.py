"""Hostile torch DCP input, crafted here: records whose storage would expand (stride 0) or inflate
(deflate) far beyond what the metadata says, int64 overflow, deep nesting, sparse and meta
tensors, a chunk referenced millions of times, a few-byte .metadata whose memo index or counted
string would make the C unpickler allocate hundreds of MB. Each is refused with a CheckpointError (one CLI
line) before anything large is allocated."""

import io
import pickle
import pickletools
import struct
import time
import tracemalloc
import zipfile

import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp_md

from hyper_parallel import checkpoint as hdcp
from hyper_parallel._torch_compat import dcp_storage_info
from hyper_parallel.core.distributed_checkpoint.cli import main
from hyper_parallel.core.distributed_checkpoint.dcp_interop.reader import DcpFiles, translate_metadata
from hyper_parallel.core.distributed_checkpoint.dcp_interop.unpickler import unpickle_dcp_metadata
from hyper_parallel.core.distributed_checkpoint.format.metadata import MetadataIndex

_DATA = "__0_0.distcp"


def _record(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _metadata(size, chunks=None, *, layout=torch.strided, dtype=torch.float32, length=0, md=None) -> bytes:
    origin = tuple(0 for _ in size)
    if md is None:
        chunks = [dcp_md.ChunkStorageMetadata(origin, tuple(size))] if chunks is None else chunks
        md = dcp_md.TensorStorageMetadata(dcp_md.TensorProperties(dtype=dtype, layout=layout), tuple(size), chunks)
    return pickle.dumps(dcp_md.Metadata(state_dict_metadata={"w": md}, storage_data={
        dcp_md.MetadataIndex("w", origin): dcp_storage_info(_DATA, 0, length)}))


def _dcp_dir(tmp_path, name, metadata: bytes, record: bytes = b"") -> str:
    path = tmp_path / name
    path.mkdir()
    (path / ".metadata").write_bytes(metadata)
    (path / _DATA).write_bytes(record)
    return str(path)


def _refused_everywhere(path, match, capsys, tmp_path):
    """load and import-dcp raise CheckpointError; the CLI prints one line and exits 1."""
    with pytest.raises(hdcp.CheckpointError, match=match):
        hdcp.load({"w": torch.zeros(4)}, checkpoint_id=path, no_dist=True, verify=False)
    capsys.readouterr()
    assert main(["import-dcp", path, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert not (tmp_path / "out").exists()


def _read_chunk(path):
    metadata = translate_metadata(path)
    files = DcpFiles(path, metadata)
    try:
        return files.read(MetadataIndex("w", (0,)))
    finally:
        files.close()


def test_stride_zero_record_cannot_expand_past_its_storage(tmp_path, capsys):
    huge = 1 << 33  # 32 GiB of float32 from a 4-byte storage
    record = _record(torch.zeros(1).expand(huge))
    assert len(record) < 2048
    path = _dcp_dir(tmp_path, "stride0", _metadata((huge,), length=len(record)), record)
    tracemalloc.start()
    try:
        with pytest.raises(hdcp.CheckpointError, match=r"declares a storage of 4 bytes .* has 34359738368"):
            _read_chunk(path)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    assert main(["import-dcp", path, str(tmp_path / "out")]) == 1
    assert "declares a storage of 4 bytes" in capsys.readouterr().err


def _deflated_record(declared: int) -> bytes:
    """torch.save of a 4-element float tensor whose storage entry is replaced by ``declared``
    zero bytes, deflate-compressed (about 1/1000 of that on disk)."""
    original = zipfile.ZipFile(io.BytesIO(_record(torch.arange(4.0))))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name in original.namelist():
            if name.endswith("/data/0"):
                info = zipfile.ZipInfo(name)
                info.compress_type = zipfile.ZIP_DEFLATED
                with archive.open(info, "w", force_zip64=True) as f:
                    block = bytes(1 << 20)
                    for _ in range(declared >> 20):
                        f.write(block)
            else:
                archive.writestr(name, original.read(name))
    return out.getvalue()


def test_deflated_record_is_refused_by_its_declared_size_before_inflating(tmp_path):
    declared = 64 << 20
    record = _deflated_record(declared)
    assert len(record) < declared // 500
    path = _dcp_dir(tmp_path, "deflate", _metadata((4,), length=len(record)), record)
    tracemalloc.start()
    try:
        with pytest.raises(hdcp.CheckpointError, match=rf"declares {declared} bytes, more than the 16"):
            _read_chunk(path)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("case", ["sparse", "meta"])
def test_sparse_and_meta_records_are_refused(tmp_path, capsys, case):
    value = torch.zeros(4).to_sparse() if case == "sparse" else torch.empty(4, device="meta")
    record = _record(value)
    path = _dcp_dir(tmp_path, case, _metadata((4,), length=len(record)), record)
    _refused_everywhere(path, r"references torch\._utils\._rebuild_(sparse_tensor|meta_tensor_no_storage), which "
                              r"is not part of a dense tensor", capsys, tmp_path)


def test_sparse_layout_in_the_metadata_is_refused(tmp_path, capsys):
    record = _record(torch.zeros(4))
    path = _dcp_dir(tmp_path, "layout", _metadata((4,), layout=torch.sparse_coo, length=len(record)), record)
    _refused_everywhere(path, r"'w' has layout torch.sparse_coo; only dense", capsys, tmp_path)


def test_sizes_beyond_int64_are_refused(tmp_path, capsys):
    path = _dcp_dir(tmp_path, "overflow", _metadata((2**64,), length=10))
    _refused_everywhere(path, r"'w' has size \(18446744073709551616,\)", capsys, tmp_path)
    path = _dcp_dir(tmp_path, "bytes", _metadata((2**62,), length=10))  # elements fit, bytes do not
    _refused_everywhere(path, r"has more than 9223372036854775807 bytes", capsys, tmp_path)


def _deep_list_pickle(depth: int) -> bytes:
    """A pickle of a list nested ``depth`` deep (pickle.dumps itself would recurse)."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def test_deeply_nested_metadata_entry_is_refused_in_one_line(tmp_path, capsys):
    placeholder = "P" * 16
    whole = pickle.dumps(dcp_md.Metadata(state_dict_metadata={"w": placeholder}, storage_data={}), protocol=2)
    text = pickle.dumps(placeholder, protocol=2)[2:-1]  # its BINUNICODE opcode (with BINPUT)
    assert whole.count(text[:21]) == 1
    deep = whole.replace(text[:21], _deep_list_pickle(200_000)[2:-1])
    path = _dcp_dir(tmp_path, "deep", deep)
    _refused_everywhere(path, r"'w' has metadata (\[\[\[|a list)", capsys, tmp_path)


def test_a_chunk_referenced_millions_of_times_is_refused_at_once(tmp_path):
    chunk = dcp_md.ChunkStorageMetadata((0,), (1,))
    metadata = _metadata((1,), [chunk] * 2_000_000, length=10)  # memo references: ~2 bytes each
    assert len(metadata) < 5 << 20
    path = _dcp_dir(tmp_path, "refs", metadata)
    started = time.monotonic()
    with pytest.raises(hdcp.CheckpointError, match=r"'w' lists its chunk at \(0,\) more than once"):
        translate_metadata(path)
    assert time.monotonic() - started < 3  # (it took 90-100 s when every reference was compared)


_MEMO_INDEX = 1 << 24  # the C unpickler sizes its memo table to twice the index: 256 MiB of pointers
_DECLARED = 1 << 28  # a counted string's length: the C unpickler allocates it before reading


@pytest.mark.parametrize("hostile, match", [
    (b"\x80\x02N" + b"r" + struct.pack("<I", _MEMO_INDEX) + b".",  # LONG_BINPUT
     rf"opcode at byte 3 stores memo entry {_MEMO_INDEX} after 0 were stored"),
    (b"N" + b"p%d\n." % _MEMO_INDEX, rf"opcode at byte 1 stores memo entry {_MEMO_INDEX} after 0"),  # protocol 0's PUT
    (b"\x80\x05\x8e" + struct.pack("<Q", _DECLARED) + b"ab.",  # BINBYTES8
     rf"opcode at byte 2 declares {_DECLARED} bytes; the file ends at byte 14"),
    (b"\x80\x04\x95" + struct.pack("<Q", 1 << 63) + b"N.",  # a FRAME past the end (torch: an OverflowError)
     r"frame at byte 2 declares 9223372036854775808 bytes; the file ends at byte 13"),
], ids=["long_binput", "put", "binbytes8", "frame"])
def test_a_few_byte_hostile_metadata_is_refused_before_unpickling_it(tmp_path, capsys, hostile, match):
    assert len(hostile) < 16
    path = _dcp_dir(tmp_path, "memo", hostile)
    tracemalloc.start()
    try:
        with pytest.raises(hdcp.CheckpointError, match=r"memo/\.metadata is not a readable torch DCP \.metadata "
                                                       r"pickle: the " + match):
            translate_metadata(path)
        assert tracemalloc.get_traced_memory()[1] < 4 << 20
    finally:
        tracemalloc.stop()
    _refused_everywhere(path, match, capsys, tmp_path)


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_metadata_pickled_at_any_protocol_passes_the_opcode_scan(protocol):
    chunks = [dcp_md.ChunkStorageMetadata((i, 0), (1, 2)) for i in range(300)]
    original = pickle.loads(_metadata((300, 2), chunks, dtype=torch.bfloat16, length=10))
    data = pickle.dumps(original, protocol=protocol)
    stores = {op.name for op, _, _ in pickletools.genops(data)} & {"BINPUT", "LONG_BINPUT", "MEMOIZE"}
    assert stores == ({"BINPUT", "LONG_BINPUT"} if protocol < 4 else {"MEMOIZE"})  # (indices past 255: 4 bytes)
    assert unpickle_dcp_metadata(data, "m").state_dict_metadata == original.state_dict_metadata


# ----------------------------------------------------------------- bombs: budgets by input size


def _value_dcp_dir(tmp_path, name, record: bytes) -> str:
    """A DCP directory whose one entry, the value "v", is ``record``."""
    metadata = pickle.dumps(dcp_md.Metadata(state_dict_metadata={"v": dcp_md.BytesStorageMetadata()}, storage_data={
        dcp_md.MetadataIndex("v"): dcp_storage_info(_DATA, 0, len(record))}))
    return _dcp_dir(tmp_path, name, metadata, record)


def _refused_fast_in_one_line(path, match, capsys, tmp_path, state):
    """load of ``state`` and import-dcp refuse ``path`` within seconds, with a short message."""
    started = time.monotonic()
    with pytest.raises(hdcp.CheckpointError, match=match) as raised:
        hdcp.load(state, checkpoint_id=path, no_dist=True, verify=False)
    assert len(str(raised.value)) < 1000
    capsys.readouterr()
    assert main(["import-dcp", path, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and len(err) < 1000, err[:2000]
    assert not (tmp_path / "out").exists()
    assert time.monotonic() - started < 10


@pytest.mark.timeout(60)
def test_nested_path_arguments_in_the_metadata_are_refused(tmp_path, capsys):
    """Each level a path of two copies of the last: 11 bytes double the name (2**40 characters)."""
    levels = 40
    bomb = b"\x80\x02cpathlib\nPurePosixPath\nq\x00h\x00X\x0a\x00\x00\x00aaaaaaaaaa\x85Rq\x01"
    for level in range(1, levels):
        bomb += b"h\x00h" + bytes([level]) + b"h" + bytes([level]) + b"\x86Rq" + bytes([level + 1])
    bomb += b"."
    assert len(bomb) < 500
    path = _dcp_dir(tmp_path, "paths", bomb)
    _refused_fast_in_one_line(path, r"a PurePosixPath built from \(PurePosixPath\('aaaaaaaaaa'\), .*plain strings",
                              capsys, tmp_path, {"w": torch.zeros(4)})


@pytest.mark.timeout(60)
def test_an_error_about_shared_references_prints_a_bounded_line(tmp_path, capsys):
    """A dtype field holding a list shared 2**24 times over (repr: ~400 MB) from a few hundred bytes."""
    shared = ["x" * 16]
    for _ in range(24):
        shared = [shared, shared]
    md = dcp_md.TensorStorageMetadata(dcp_md.TensorProperties(dtype=shared), (4,), [dcp_md.ChunkStorageMetadata((0,), (4,))])
    metadata = _metadata((4,), md=md)
    assert len(metadata) < 2000
    path = _dcp_dir(tmp_path, "reprs", metadata)
    _refused_fast_in_one_line(path, r"'w' has no dense tensor dtype \(TensorProperties\(dtype=\[\[<a list>, <a list>\], .*\(5 in all\)\)\)$",
                              capsys, tmp_path, {"w": torch.zeros(4)})


def _zip_record(pickled: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", pickled)
    return buffer.getvalue()


@pytest.mark.timeout(60)
def test_a_data_pkl_declaring_gigabytes_is_refused_before_allocating_them(tmp_path, capsys):
    pickled = b"\x80\x05\x96" + struct.pack("<Q", 1 << 31) + b"."  # BYTEARRAY8 of 2 GiB, 12 bytes
    path = _value_dcp_dir(tmp_path, "bytearray", _zip_record(pickled))
    tracemalloc.start()
    try:
        with pytest.raises(hdcp.CheckpointError, match=r"data.pkl: the opcode at byte 2 declares 2147483648 bytes"):
            hdcp.load({"v": 0}, checkpoint_id=path, no_dist=True, verify=False)
        assert tracemalloc.get_traced_memory()[1] < 16 << 20
    finally:
        tracemalloc.stop()
    _refused_fast_in_one_line(path, "2147483648 bytes", capsys, tmp_path, {"v": 0})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("depth", [20, 60])
def test_a_billion_laughs_value_is_refused_not_expanded(tmp_path, capsys, depth):
    laughs = "ha"
    for _ in range(depth):
        laughs = [laughs, laughs]
    record = _record(laughs)
    assert len(record) < 2000
    path = _value_dcp_dir(tmp_path, f"laughs{depth}", record)
    _refused_fast_in_one_line(path, r"value 'v' in .* would be more than 16x its \d+-byte pickle written out",
                              capsys, tmp_path, {"v": 0})


def test_a_plain_value_with_a_shared_string_still_imports(tmp_path):
    name = "layers.0.attention.wq.weight"
    path = _value_dcp_dir(tmp_path, "shared", _record({"params": [name] * 3, "betas": [0.9, 0.95]}))
    assert main(["import-dcp", path, str(tmp_path / "out")]) == 0
    state = {"v": None}
    hdcp.load(state, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    assert state["v"] == {"params": [name] * 3, "betas": [0.9, 0.95]}
