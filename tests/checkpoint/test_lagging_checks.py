"""Checked reads straight into memory never wait for the checksums (block_reads.py): a slow
crc thread (a busy machine) must not stall the reads; the checks still all run, in order."""

import os
import threading
import zlib

from hyper_parallel.core.distributed_checkpoint.filesystem import block_reads


def test_reads_into_memory_go_on_while_the_crc_thread_is_stalled(tmp_path, monkeypatch):
    data = os.urandom(3 * 4096)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    release = threading.Event()
    real_crc32 = block_reads.crc32

    def stalled_crc32(buffer, value=0):
        release.wait(timeout=30)
        return real_crc32(buffer, value)

    monkeypatch.setattr(block_reads, "crc32", stalled_crc32)
    reads = block_reads.BlockReads(block_bytes=1024)  # several blocks per chunk
    fd = os.open(path, os.O_RDONLY)
    checked, targets = [], [bytearray(4096) for _ in range(3)]
    try:
        done = threading.Thread(target=lambda: [reads.read_into(fd, t, i * 4096, str(path), checked.append)
                                                for i, t in enumerate(targets)])
        done.start()
        done.join(timeout=20)
        assert not done.is_alive(), "a read waited for the stalled checksum"
        assert b"".join(targets) == data and checked == []  # all read, nothing checked yet
        release.set()
        reads.settle()
        assert checked == [zlib.crc32(data[i * 4096:(i + 1) * 4096]) for i in range(3)]
    finally:
        release.set()
        reads.close()
        os.close(fd)
