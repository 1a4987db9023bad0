"""A rank's write results between ranks without collectives (an async save's commit): the
JSON of its "done" marker, the coordinator's wait for every rank's marker, and the results
recorded in the checkpoint's metadata. Where the markers live is the backend's."""

from __future__ import annotations

import json
from typing import Dict, Iterable, List

from hyper_parallel.core.distributed_checkpoint.format.metadata import FileInfo, Metadata, MetadataIndex, StorageInfo
from hyper_parallel.core.distributed_checkpoint.storage import RankWriteResult, WriteResult


def results_to_json(result: RankWriteResult) -> str:
    """A rank's write results as the JSON text of its async "done" marker."""
    return json.dumps({
        "items": [[r.index.fqn, r.index.offset, r.index.index, r.storage.relative_path, r.storage.offset,
                   r.storage.length, r.storage.checksum, r.storage.encoding] for r in result.items],
        "files": {n: [f.size, f.checksum] for n, f in result.files.items()},
    })


def results_from_json(text: str) -> RankWriteResult:
    """The write results of a "done" marker's JSON text."""
    doc = json.loads(text)
    items = [WriteResult(MetadataIndex(fqn, None if off is None else tuple(off), idx),
                         StorageInfo(path, start, length, crc, enc))
             for fqn, off, idx, path, start, length, crc, enc in doc["items"]]
    return RankWriteResult(items, {n: FileInfo(s, c) for n, (s, c) in doc["files"].items()})


def record_results(metadata: Metadata, results: List[RankWriteResult]) -> None:
    """Add every rank's written items and files to ``metadata``."""
    for result in results:
        for r in result.items:
            metadata.storage_data[r.index] = r.storage
        metadata.files.update(result.files)


class DoneMarkers:
    """The coordinator's wait for every rank's "done" marker: ``names`` maps each rank to its
    marker's name; :meth:`seen` is given each listing of where they appear."""

    def __init__(self, names: Dict[int, str]) -> None:
        self.names = [names[rank] for rank in sorted(names)]
        self._missing = dict(names)

    def seen(self, listing: Iterable[str]) -> bool:
        """Note the markers in ``listing``; True once every rank's has been seen."""
        listed = set(listing)
        self._missing = {rank: name for rank, name in self._missing.items() if name not in listed}
        return not self._missing

    def missing_ranks(self) -> List[int]:
        """The ranks whose marker has not been seen yet."""
        return sorted(self._missing)

    def waiting_for(self) -> str:
        """What the wait is for, for a timeout's message."""
        return f"ranks did not finish writing (missing {sorted(self._missing.values())[:8]})"
