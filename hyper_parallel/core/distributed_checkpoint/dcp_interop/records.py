"""DCP's data records (``torch.save`` zip archives: ``data.pkl`` plus one ``data/<key>`` entry
per storage) read without ``torch.load``, so that nothing is allocated before it is checked.

``data.pkl`` is unpickled by a restricted unpickler (the pure-Python one: its memo is a dict,
so a pickle cannot make it size a memo table) that admits only what a tensor record
references (``_rebuild_tensor_v2``/``_v3``, the typed storage classes, dtypes,
``OrderedDict``) and builds descriptions, not tensors: a storage's declared size, a tensor's
dtype, size, stride and offset. Those are checked against the DCP metadata (the chunk's dtype
and shape; the storage exactly as large as the chunk, so a stride-0 record cannot expand; the
``data/<key>`` entry declaring that many bytes) before the chunk's buffer is allocated, and
the entry is then read (inflated, if compressed) into it block by block, never past its size.
A value's record must hold plain data (numbers, strings, lists, dicts, nested at most
``MAX_VALUE_NESTING`` deep) whose size, counted as written out (a list shared twice counts
twice, a string by its length), is at most a small multiple of the pickle's: a "billion laughs"
record of shared references is refused after that many steps, not expanded. ``data.pkl`` is
scanned first (:func:`~.unpickler.scan_pickle`), so a counted argument (``BYTEARRAY8 2**31``)
longer than the file is refused before the unpickler allocates it.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import sys
import zipfile
from typing import Any, Callable, List, Tuple

import torch

from hyper_parallel._torch_compat import tensor_rebuild_version
from hyper_parallel.core.distributed_checkpoint.dcp_interop.unpickler import scan_pickle, torch_dtype
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError, short_repr
from hyper_parallel.core.distributed_checkpoint.format.metadata import MetadataIndex, StorageInfo, TensorStorageMetadata
from hyper_parallel.core.distributed_checkpoint.format.values import MAX_VALUE_NESTING

__all__ = ["ReadAt", "read_record"]

ReadAt = Callable[[int, memoryview], int]
"""Fill (part of) a buffer from a data file at an offset; returns the bytes read (0 at its end)."""

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's zip format; DCP's other serialisations are refused
_BLOCK = 1 << 20  # bytes inflated/copied at a time (each passes through two temporary copies)
_MAX_INDEX = 2**62  # sizes, strides, offsets and byte counts above this are refused
_PLAIN = (type(None), bool, int, float, str)
_LEGACY_STORAGES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128, "ComplexFloatStorage": torch.complex64,
}


class _FileSlice(io.RawIOBase):
    """Bytes ``offset..offset+length`` of a data file as a seekable read-only file."""

    def __init__(self, read_at: ReadAt, offset: int, length: int) -> None:
        super().__init__()
        self._read_at, self._start, self._length, self._at = read_at, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._length}[whence]
        self._at = max(0, base + position)
        return self._at

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = max(0, min(len(view), self._length - self._at))
        done = self._read_at(self._start + self._at, view[:wanted]) if wanted else 0
        self._at += done
        return done


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _StorageRef:
    """A storage the pickle declares: its record key, element type and size (not read)."""

    def __init__(self, key: str, dtype: torch.dtype, nbytes: int, location: str) -> None:
        self.key, self.dtype, self.nbytes, self.location = key, dtype, nbytes, location


class _TensorRef:
    """A tensor the pickle declares over a storage (not built)."""

    def __init__(self, storage: Any, offset: Any, size: Any, stride: Any, dtype: Any) -> None:
        if not isinstance(storage, _StorageRef) or not isinstance(dtype, torch.dtype):
            raise ValueError("a tensor without a storage")
        self.storage, self.offset, self.size, self.stride, self.dtype = storage, offset, size, stride, dtype


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> _TensorRef:
    return _TensorRef(storage, offset, size, stride, getattr(storage, "dtype", None))


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any,
                *_: Any) -> _TensorRef:
    return _TensorRef(storage, offset, size, stride, dtype)


class _Refused(Exception):
    """A global the record references and this reader does not admit."""


class _RecordUnpickler(pickle._Unpickler):  # the pure-Python unpickler: a dict memo, no recursion
    def find_class(self, module: str, name: str) -> Any:
        version = tensor_rebuild_version(module, name)
        if version is not None:
            return _rebuild_v2 if version == 2 else _rebuild_v3
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _LEGACY_STORAGES:
            return _StorageType(_LEGACY_STORAGES[name])
        if (module, name) == ("torch", "UntypedStorage"):
            return _StorageType(torch.uint8)
        found = torch_dtype(name) if module == "torch" else None
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and isinstance(pid[3], str)
                and type(pid[4]) is int and 0 <= pid[4] <= _MAX_INDEX):
            raise ValueError(f"a storage reference {str(pid)[:200]}")
        return _StorageRef(pid[2], pid[1].dtype, pid[4] * pid[1].dtype.itemsize, pid[3])


_VALUE_BUDGET_PER_BYTE, _VALUE_BUDGET_FLOOR = 16, 4096


class _TooLarge(Exception):
    """A value that, written out, is far larger than its pickle (shared references)."""


def _plain(value: Any, budget: List[int], depth: int = 0) -> bool:
    """Whether ``value`` is plain data nested at most MAX_VALUE_NESTING deep; each item (and
    each character of a string) spends one unit of ``budget[0]``.

    Raises:
        _TooLarge: the budget is spent.
    """
    budget[0] -= 1 + (len(value) if isinstance(value, str) else 0)
    if budget[0] < 0:
        raise _TooLarge
    if isinstance(value, _PLAIN):
        return True
    if depth >= MAX_VALUE_NESTING:
        return False
    if isinstance(value, (list, tuple)):
        return all(_plain(v, budget, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, _PLAIN) and _plain(k, budget, depth + 1) and _plain(v, budget, depth + 1)
                   for k, v in value.items())
    return False


def _describe(value: Any) -> str:
    if isinstance(value, _TensorRef):
        return f"a {value.dtype} tensor of shape {str(value.size)[:200]}"
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} that is not plain data or nests deeper than {MAX_VALUE_NESTING} levels"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def _dims(value: Any, ndim: int) -> bool:
    return (isinstance(value, (tuple, list)) and len(value) == ndim
            and all(type(v) is int and 0 <= v <= _MAX_INDEX for v in value))


def _check_tensor(ref: Any, sizes: Tuple[int, ...], md: TensorStorageMetadata, where: str) -> None:
    if not isinstance(ref, _TensorRef):
        raise CheckpointError(f"{where} holds {_describe(ref)}, the metadata says a {md.dtype} tensor")
    if ref.dtype != md.dtype or not _dims(ref.size, len(sizes)) or tuple(ref.size) != sizes:
        raise CheckpointError(f"{where} holds {_describe(ref)}, the metadata says a {md.dtype} tensor of "
                              f"shape {sizes}")
    needed = math.prod(sizes) * md.dtype.itemsize
    storage = ref.storage
    if storage.location == "meta" or storage.nbytes != needed:
        raise CheckpointError(f"{where} declares a storage of {storage.nbytes} bytes ({storage.location}); its "
                              f"chunk of shape {sizes} ({md.dtype}) has {needed}")
    if not (_dims(ref.stride, len(sizes)) and type(ref.offset) is int and 0 <= ref.offset <= _MAX_INDEX):
        raise CheckpointError(f"{where} has strides {str(ref.stride)[:200]} / offset {ref.offset!r}")
    reach = ref.offset + sum((n - 1) * s for n, s in zip(sizes, ref.stride)) + 1 if needed else 0
    if reach * md.dtype.itemsize > needed:
        raise CheckpointError(f"{where} has strides {tuple(ref.stride)} and offset {ref.offset} reaching past its "
                              f"storage of {needed} bytes")


def _entry(archive: zipfile.ZipFile, name: str, limit: int, where: str) -> zipfile.ZipInfo:
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise CheckpointError(f"{where} has no {name!r} entry") from None
    if info.file_size > limit:
        raise CheckpointError(f"{where}: its entry {name!r} declares {info.file_size} bytes, more than the "
                              f"{limit} the metadata allows")
    return info


def _fill(archive: zipfile.ZipFile, info: zipfile.ZipInfo, out: memoryview) -> None:
    """Read the entry ``info`` (exactly ``len(out)`` bytes, inflated if compressed) into ``out``."""
    done = 0
    with archive.open(info) as f:
        while done < len(out):
            block = f.read(min(_BLOCK, len(out) - done))
            if not block:
                raise zipfile.BadZipFile(f"entry {info.filename!r} ends after {done} of its {len(out)} bytes")
            out[done:done + len(block)] = block
            done += len(block)
        if f.read(1):
            raise zipfile.BadZipFile(f"entry {info.filename!r} holds more than its {len(out)} bytes")


def _materialise(archive: zipfile.ZipFile, prefix: str, ref: _TensorRef, sizes: Tuple[int, ...],
                 where: str) -> torch.Tensor:
    nbytes = ref.storage.nbytes
    info = _entry(archive, f"{prefix}data/{ref.storage.key}", nbytes, where)
    if info.file_size != nbytes:
        raise CheckpointError(f"{where}: its storage entry holds {info.file_size} bytes, the chunk needs {nbytes}")
    raw = torch.empty(nbytes, dtype=torch.uint8)
    _fill(archive, info, memoryview(raw.numpy()).cast("B"))
    flat = raw.view(ref.dtype)
    contiguous = torch.empty(sizes, device="meta").stride() if sizes else ()
    if ref.offset == 0 and tuple(ref.stride) == tuple(contiguous):
        return flat.view(sizes)
    return torch.as_strided(flat, sizes, tuple(ref.stride), ref.offset).contiguous()


def _unpickle(archive: zipfile.ZipFile, limit: int, where: str) -> Tuple[str, Any, int]:
    """The record's prefix, its unpickled ``data.pkl`` and that pickle's size."""
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise CheckpointError(f"{where} is not a torch.save record: it has {len(pickles)} data.pkl entries")
    prefix = pickles[0][:-len("data.pkl")]
    if prefix + "byteorder" in archive.namelist():
        order = archive.read(_entry(archive, prefix + "byteorder", 16, where)).decode(errors="replace")
        if order != sys.byteorder:
            raise CheckpointError(f"{where} was saved {order}-endian; this host is {sys.byteorder}-endian")
    data = archive.read(_entry(archive, pickles[0], limit, where))
    problem = scan_pickle(data)
    if problem is not None:
        raise CheckpointError(f"{where} is not a readable torch.save record: its data.pkl: {problem}")
    return prefix, _RecordUnpickler(io.BytesIO(data)).load(), len(data)


def read_record(read_at: ReadAt, file_size: int, path: str, info: StorageInfo, index: MetadataIndex,
                md: Any) -> Any:
    """One stored DCP item: the tensor chunk at ``index.offset`` (``md``: our tensor metadata;
    returned contiguous) or a plain value, from its byte range of the data file ``path``.

    Raises:
        CheckpointError: a truncated file, not a ``torch.save`` record, a record referencing
            anything but a dense tensor's parts, a chunk of another dtype/shape or whose storage
            is not exactly the chunk's bytes, a value that is not plain data (names the key
            and the file).
    """
    key = short_repr(index.fqn)
    end = info.offset + info.length
    if end > file_size:
        raise CheckpointError(f"{path} is truncated: {key} needs bytes {info.offset}..{end} but the file ends "
                              f"at {file_size}")
    is_tensor = isinstance(md, TensorStorageMetadata)
    where = f"{key} chunk {index.offset} in {path}" if is_tensor else f"value {key} in {path}"
    record = _FileSlice(read_at, info.offset, info.length)
    magic = bytearray(len(_ZIP_MAGIC))
    if record.readinto(magic) != len(magic) or magic != _ZIP_MAGIC:
        raise CheckpointError(f"{key} in {path} (bytes {info.offset}..{end}) is not a torch.save record: only "
                              "DCP's default serialization (torch_save) can be read")
    record.seek(0)
    try:
        with zipfile.ZipFile(record) as archive:
            prefix, value, pickled = _unpickle(archive, info.length, where)
            if not is_tensor:
                budget = [_VALUE_BUDGET_PER_BYTE * pickled + _VALUE_BUDGET_FLOOR]
                try:
                    plain = not isinstance(value, _TensorRef) and _plain(value, budget)
                except _TooLarge:
                    raise CheckpointError(f"{where} would be more than {_VALUE_BUDGET_PER_BYTE}x its "
                                          f"{pickled}-byte pickle written out (shared references, as in a "
                                          "'billion laughs'); refusing it") from None
                if not plain:
                    raise CheckpointError(f"{where} is {_describe(value)}: only plain data (numbers, strings, lists, "
                                          "dicts) can be read; leave it out (import-dcp --exclude)")
                return value
            sizes = md.chunks.sizes_at(index.offset)
            _check_tensor(value, sizes, md, where)
            return _materialise(archive, prefix, value, sizes, where)
    except CheckpointError:
        raise
    except _Refused as exc:
        if not is_tensor:
            raise CheckpointError(f"{where} is not plain data (it holds a {exc}): only plain data (numbers, strings, "
                                  "lists, dicts) can be read; leave it out (import-dcp --exclude)") from None
        raise CheckpointError(f"{where} references {exc}, which is not part of a dense tensor; refusing it") from None
    except Exception as exc:  # noqa: BLE001 - a damaged zip or pickle raises many kinds; all mean unreadable
        raise CheckpointError(f"{where} is not a readable torch.save record "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from None
