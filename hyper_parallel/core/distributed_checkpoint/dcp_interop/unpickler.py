"""A torch DCP checkpoint's ``.metadata`` pickle, read without running anything but DCP's own
metadata classes.

``pickle.load`` on a file someone handed you runs whatever callable the file names. This
unpickler resolves only the globals a DCP ``.metadata`` written by torch's ``FileSystemWriter``
references (found with ``pickletools.dis`` on real ones): DCP's metadata dataclasses, the
per-item storage location, ``torch.Size``, torch dtypes and layouts, the memory-format enum,
``pathlib`` paths (``StorageMeta.checkpoint_id``) and ``collections.OrderedDict``; plain
containers need no global. Anything else is refused, naming ``module.name`` and the file,
before it is called. The result is then checked field by field (:func:`read_dcp_metadata`).

It is read by the C unpickler (2-3x as fast as the pure-Python one on large files; the scan
adds about a quarter: ``benchmarks/dcp_metadata_read.py``) after a pre-scan of its opcodes
(:func:`scan_pickle`): the C unpickler sizes its memo table to the largest index a PUT names
and allocates a counted string's declared length before reading it, so a few bytes could make
it allocate gigabytes. The scan refuses a memo index past the number of objects stored so far
(a pickler numbers them in order) and a counted argument or frame longer than the rest of the
file; what the C unpickler then allocates stays a small multiple of the file's size, as any
pickle's objects do.
"""

from __future__ import annotations

import collections
import io
import math
import pathlib
import pickle
import pickletools
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch.distributed.checkpoint import metadata as dcp_md

from hyper_parallel._torch_compat import dcp_mem_format_encoding, dcp_storage_info, get_layout
from hyper_parallel.core.distributed_checkpoint._fileio import read_regular_file, url_scheme
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError, short_repr
from hyper_parallel.core.distributed_checkpoint.format.metadata import MAX_DIMS, MAX_METADATA_BYTES, check_relative_path
from hyper_parallel.core.distributed_checkpoint.object_store import store

__all__ = ["DCP_METADATA_FILE", "read_dcp_metadata", "scan_pickle", "torch_dtype", "unpickle_dcp_metadata"]

DCP_METADATA_FILE = ".metadata"
_MAX_INT = 2**63 - 1  # sizes, offsets and byte counts must fit int64 (what torch indexes with)
_INTEGRAL = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                       torch.uint16, torch.uint32, torch.uint64})
_MAX_PATH_CHARS = 4096  # a pathlib path in a .metadata (StorageMeta.checkpoint_id) is a name, at most this long


def _path_from_strings(cls: type) -> Callable[..., Any]:
    """``cls(*parts)`` for plain string parts of at most _MAX_PATH_CHARS together: a pickle
    cannot nest paths in paths (each level would double the name's length)."""
    def build(*parts: Any) -> Any:
        if not all(type(p) is str for p in parts) or sum(len(p) for p in parts) > _MAX_PATH_CHARS:
            raise ValueError(f"a {cls.__name__} built from {short_repr(parts)}: a DCP .metadata path is made of "
                             f"plain strings of at most {_MAX_PATH_CHARS} characters")
        return cls(*parts)
    return build

_ALLOWED: Dict[Tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.metadata", cls.__name__): cls
    for cls in (dcp_md.Metadata, dcp_md.TensorStorageMetadata, dcp_md.BytesStorageMetadata,
                dcp_md.ChunkStorageMetadata, dcp_md.TensorProperties, dcp_md.MetadataIndex,
                dcp_md.StorageMeta, dcp_mem_format_encoding)
}
_ALLOWED.update({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_storage_info,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): get_layout,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("pathlib", "PosixPath"): _path_from_strings(pathlib.PurePosixPath),  # a name only: never touches the disk
    ("pathlib", "PurePosixPath"): _path_from_strings(pathlib.PurePosixPath),
    ("pathlib", "WindowsPath"): _path_from_strings(pathlib.PureWindowsPath),
    ("pathlib", "PureWindowsPath"): _path_from_strings(pathlib.PureWindowsPath),
})


def torch_dtype(name: str) -> Any:
    """The dtype ``torch.<name>`` (as pickles reference dtypes), or None."""
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


def _torch_attribute(name: str) -> Any:
    value = getattr(torch, name, None)
    return value if isinstance(value, (torch.dtype, torch.layout)) else None


class _DcpUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None and module == "torch":
            found = _torch_attribute(name)  # torch.float32 & co. are pickled by name
        if found is None:
            raise CheckpointError(
                f"{self.source} references {module}.{name}, which is not one of torch DCP's metadata "
                "classes; refusing to unpickle it (a DCP .metadata holds only those and plain containers)"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.source} holds a persistent reference; a DCP .metadata has none")


# ------------------------------------------------ the opcode pre-scan (before the C unpickler runs)

# How each opcode's argument is skipped, from pickletools' opcode table (so every protocol's
# opcodes are known): most have a fixed size (_FIXED_SIZE, -1 for the others); the others are
# a memo store, a newline-ended line (two for GLOBAL/INST), a count of 1/4/8 bytes followed by
# that many, FRAME or STOP. (A walk of its own: pickletools.genops, which decodes every argument,
# took 2.5-3x as long as a first version of this scan on a 27 MB .metadata, and the fixed-size
# fast path halved that version's time.)
_LINES, _COUNTED, _SIGNED_COUNTED, _FRAME, _PUT_LINE, _PUT_INDEX, _STOP = range(7)
_COUNT_BYTES = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
                pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}
_MEMOIZE = pickle.MEMOIZE[0]


def _opcode_tables() -> Tuple[List[int], Dict[int, Tuple[int, int]]]:
    fixed, special = [-1] * 256, {}
    for op in pickletools.opcodes:
        code, n = op.code.encode("latin-1")[0], op.arg.n if op.arg is not None else 0
        if op.name == "STOP":
            special[code] = (_STOP, 0)
        elif op.name == "FRAME":  # (a count of the opcodes that follow, which are scanned)
            special[code] = (_FRAME, n)
        elif op.name == "PUT":
            special[code] = (_PUT_LINE, 1)
        elif op.name in ("BINPUT", "LONG_BINPUT"):
            special[code] = (_PUT_INDEX, n)
        elif n == pickletools.UP_TO_NEWLINE:
            special[code] = (_LINES, 2 if op.arg.name == "stringnl_noescape_pair" else 1)
        elif n < 0:  # (BINSTRING's and LONG4's counts are signed)
            special[code] = (_SIGNED_COUNTED if n == pickletools.TAKEN_FROM_ARGUMENT4 else _COUNTED, _COUNT_BYTES[n])
        elif code != _MEMOIZE:
            fixed[code] = n
    return fixed, special


_FIXED_SIZE, _SPECIAL = _opcode_tables()


def scan_pickle(data: bytes) -> Optional[str]:
    """What makes ``data`` unsafe to unpickle (a memo index past the objects stored so far, a
    counted argument or frame past the end, e.g. a ``BYTEARRAY8`` declaring 2 GiB in a 12-byte
    file, an unknown opcode, no STOP), or None."""
    pos, end, stored, fixed = 0, len(data), 0, _FIXED_SIZE
    from_bytes = int.from_bytes
    while pos < end:
        code = data[pos]
        n = fixed[code]
        if n >= 0:
            pos += n + 1
            continue
        if code == _MEMOIZE:
            stored += 1
            pos += 1
            continue
        at = pos
        if code not in _SPECIAL:
            return f"unknown opcode {code:#04x} at byte {at}"
        kind, n = _SPECIAL[code]
        pos += 1
        if kind == _COUNTED or kind == _SIGNED_COUNTED:
            count = from_bytes(data[pos:pos + n], "little", signed=kind == _SIGNED_COUNTED)
            pos += n + count
            if count < 0 or pos > end:
                return f"the opcode at byte {at} declares {count} bytes; the file ends at byte {end} (truncated?)"
        elif kind == _FRAME:
            count, pos = from_bytes(data[pos:pos + n], "little"), pos + n
            if pos + count > end:
                return f"the frame at byte {at} declares {count} bytes; the file ends at byte {end} (truncated?)"
        elif kind == _PUT_INDEX or kind == _PUT_LINE:
            if kind == _PUT_INDEX:
                index, pos = from_bytes(data[pos:pos + n], "little"), pos + n
            else:
                line_end = data.find(b"\n", pos)
                digits, pos = data[pos:line_end].strip(), line_end + 1
                index = int(digits) if line_end >= 0 and digits.isdigit() and len(digits) < 20 else -1
            if not 0 <= index <= stored:
                return (f"the opcode at byte {at} stores memo entry {index} after {stored} were stored (a pickle "
                        "numbers them in order)")
            stored += 1
        elif kind == _LINES:
            for _ in range(n):
                line_end = data.find(b"\n", pos)
                pos = line_end + 1 if line_end >= 0 else end + 1
        else:  # STOP: the unpickler reads no further
            return None
    return f"it ends at byte {end} before the pickle's STOP opcode (truncated?)"


def unpickle_dcp_metadata(data: bytes, source: str) -> Any:
    """Unpickle ``data`` admitting only DCP's metadata classes, after the opcode pre-scan (see
    the module docstring).

    Raises:
        CheckpointError: a refused global, an opcode refused by the pre-scan, or a truncated /
            corrupt pickle (names ``source``).
    """
    problem = scan_pickle(data)
    if problem is not None:
        raise CheckpointError(f"{source} is not a readable torch DCP .metadata pickle: {problem}; refused before "
                              "unpickling it")
    try:
        return _DcpUnpickler(io.BytesIO(data), source).load()
    except CheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, RuntimeError, MemoryError, RecursionError, OverflowError) as exc:
        raise CheckpointError(f"{source} is not a readable torch DCP .metadata pickle "
                              f"({type(exc).__name__}: {short_repr(str(exc))}); is the file truncated?") from None


# --------------------------------------------------------------- checks of the unpickled result


def _check(ok: bool, source: str, what: Callable[[], str]) -> None:
    if not ok:
        raise CheckpointError(f"{source} is malformed: {what()}")


_short = short_repr


def _is_dims(value: Any, ndim: Optional[int] = None) -> bool:
    """A tuple of at most MAX_DIMS int64 sizes/offsets (``ndim`` of them, if given)."""
    return (isinstance(value, (tuple, list)) and len(value) <= MAX_DIMS and (ndim is None or len(value) == ndim)
            and all(type(v) is int and 0 <= v <= _MAX_INT for v in value))


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _MAX_INT


def _dense_dtype(dtype: Any) -> bool:
    return isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex or dtype in _INTEGRAL)


def _check_tensor(fqn: str, md: Any, source: str) -> None:
    properties = md.properties
    _check(isinstance(properties, dcp_md.TensorProperties) and _dense_dtype(properties.dtype), source,
           lambda: f"{_short(fqn)} has no dense tensor dtype ({_short(properties)})")
    _check(properties.layout == torch.strided, source,
           lambda: f"{_short(fqn)} has layout {_short(properties.layout)}; only dense (strided) tensors can be read")
    size = md.size
    _check(_is_dims(size), source, lambda: f"{_short(fqn)} has size {_short(size)}")
    _check(math.prod(size) * properties.dtype.itemsize <= _MAX_INT, source,
           lambda: f"{_short(fqn)} of size {tuple(size)} has more than {_MAX_INT} bytes")
    chunks = md.chunks
    _check(isinstance(chunks, list), source, lambda: f"{_short(fqn)} has chunks {_short(chunks)}")
    seen: Set[Tuple[int, ...]] = set()
    for chunk in chunks:  # (a repeated chunk is refused at once: a pickle repeats one for 2 bytes)
        _check(isinstance(chunk, dcp_md.ChunkStorageMetadata) and _is_dims(chunk.offsets, len(size))
               and _is_dims(chunk.sizes, len(size)), source,
               lambda: f"{_short(fqn)} has a chunk {_short(chunk)} that does not fit its size {tuple(size)}")
        offsets = tuple(chunk.offsets)
        _check(offsets not in seen, source, lambda: f"{_short(fqn)} lists its chunk at {offsets} more than once")
        seen.add(offsets)


def _check_storage(index: Any, info: Any, source: str) -> None:
    _check(isinstance(index, dcp_md.MetadataIndex) and isinstance(index.fqn, str)
           and (index.offset is None or _is_dims(index.offset)), source,
           lambda: f"storage_data has key {_short(index)}")
    _check(isinstance(info, dcp_storage_info) and _is_count(info.offset) and _is_count(info.length)
           and info.offset + info.length <= _MAX_INT, source,
           lambda: f"storage of {_short(index.fqn)} is {_short(info)}")
    check_relative_path(info.relative_path, source)
    transforms = info.transform_descriptors  # (the class default, None, when not pickled)
    if transforms:
        raise CheckpointError(
            f"{source}: {_short(index.fqn)} is stored through the transforms {_short(transforms)} (e.g. compression) "
            f"in {info.relative_path}; only untransformed DCP checkpoints can be read: save without them"
        )


def _check_metadata(metadata: Any, source: str) -> None:
    _check(isinstance(metadata, dcp_md.Metadata), source, lambda: f"it holds a {type(metadata).__name__}")
    _check(isinstance(metadata.state_dict_metadata, dict), source, lambda: "state_dict_metadata is not a dict")
    _check(isinstance(metadata.storage_data, dict), source,
           lambda: "storage_data is not a dict (not written by DCP's FileSystemWriter?)")
    for fqn, md in metadata.state_dict_metadata.items():
        _check(isinstance(fqn, str), source, lambda: f"key {_short(fqn)} is not a string")
        if isinstance(md, dcp_md.TensorStorageMetadata):
            _check_tensor(fqn, md, source)
        else:
            _check(isinstance(md, dcp_md.BytesStorageMetadata), source, lambda: f"{_short(fqn)} has metadata {_short(md)}")
    for index, info in metadata.storage_data.items():
        _check_storage(index, info, source)


def _read_metadata_file(directory: str, source: str) -> bytes:
    """The bytes of ``source`` (``directory``'s ``.metadata``, local or an fsspec URL), refused
    unread above MAX_METADATA_BYTES."""
    try:
        if not url_scheme(directory):
            return read_regular_file(source, MAX_METADATA_BYTES, "DCP metadata")
        fs, path = store.open_store(directory)
        name = f"{path}/{DCP_METADATA_FILE}"
        size = fs.size(name)
        if size > MAX_METADATA_BYTES:
            raise CheckpointError(f"{source} has {size} bytes, more than {MAX_METADATA_BYTES}; refused")
        return fs.cat_file(name)
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a torch DCP checkpoint: it has no {DCP_METADATA_FILE}") from None


def read_dcp_metadata(directory: str) -> Any:
    """The ``torch.distributed.checkpoint.metadata.Metadata`` of the DCP checkpoint in
    ``directory`` (a directory or an fsspec URL), unpickled with the restricted unpickler and
    checked: every entry a dense tensor (dtype, int64 size, distinct chunks inside it) or a
    value, every stored item inside the directory and without transforms (compression, which
    this reader does not undo).

    Raises:
        CheckpointError: no ``.metadata``, a refused class, or a malformed field (names the file).
    """
    source = f"{directory.rstrip('/')}/{DCP_METADATA_FILE}"
    metadata = unpickle_dcp_metadata(_read_metadata_file(directory, source), source)
    try:
        _check_metadata(metadata, source)
    except (AttributeError, TypeError, ValueError, OverflowError, RecursionError) as exc:
        # (an object the pickle built without the fields its class declares, or of odd types)
        raise CheckpointError(f"{source} is malformed: {type(exc).__name__}: {_short(str(exc))}") from None
    return metadata
