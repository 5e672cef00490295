"""The disk tier over real files: round trips, LRU, restarts, corruption, kills, threads.

Run as a script, it times puts and reads of 256 default-model-sized entries instead:
``python tests/test_kv_disk_tier.py [directory]``.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pagedllm.kv_tiers import disk_tier
from pagedllm.kv_tiers.disk_tier import HEADER_BYTES, DiskTier, slot_bytes_for

FINGERPRINT = hashlib.sha256(b"model, dtype, format, block size, shapes").digest()
ENTRY_BYTES = 20_000
SLOT_BYTES = slot_bytes_for(ENTRY_BYTES)


def digest(n: int) -> bytes:
    return hashlib.sha256(b"block %d" % n).digest()


def payload(key: bytes, entry_bytes: int = ENTRY_BYTES) -> torch.Tensor:
    """The bytes every test writes under ``key``: derived from it alone."""
    return torch.frombuffer(bytearray(random.Random(key).randbytes(entry_bytes)), dtype=torch.uint8)


def open_tier(directory: Path, entries: int = 8, **kwargs) -> DiskTier:
    entry_bytes = kwargs.pop("entry_bytes", ENTRY_BYTES)
    fingerprint = kwargs.pop("fingerprint", FINGERPRINT)
    capacity = kwargs.pop("capacity_bytes", entries * slot_bytes_for(entry_bytes))
    return DiskTier(directory, capacity, entry_bytes, fingerprint, **kwargs)


def read(tier: DiskTier, key: bytes) -> torch.Tensor | None:
    out = torch.empty(tier.entry_bytes, dtype=torch.uint8)
    return out if tier.read_into(key, out) else None


def reads_back(tier: DiskTier, key: bytes) -> bool:
    """Whether ``key`` reads back, and then bit for bit its payload (never other bytes)."""
    out = read(tier, key)
    assert out is None or torch.equal(out, payload(key, tier.entry_bytes)), "wrong bytes read"
    return out is not None


def extents(directory: Path) -> list[Path]:
    return sorted(directory.glob("kvtier-*.extent"))


def extent_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in extents(directory))


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([byte ^ 0x40]))


def test_round_trip_is_bit_identical(tmp_path):
    with open_tier(tmp_path) as tier:
        keys = [digest(n) for n in range(5)]
        for key in keys:
            tier.put(key, payload(key))
        assert len(tier) == 5 and all(key in tier for key in keys)
        assert all(reads_back(tier, key) for key in keys)
        assert not reads_back(tier, digest(99)) and digest(99) not in tier
        # any contiguous CPU tensor of entry_bytes bytes, in any dtype
        as_bf16 = payload(digest(7)).view(torch.bfloat16)
        tier.put(digest(7), as_bf16)
        out = torch.empty(ENTRY_BYTES // 2, dtype=torch.bfloat16)
        assert tier.read_into(digest(7), out) and torch.equal(
            out.view(torch.uint8), payload(digest(7))
        )
        stats = tier.stats()
    assert (stats.writes, stats.reads, stats.entries, stats.capacity_entries) == (6, 6, 6, 8)
    assert stats.bytes_written == stats.bytes_read == 6 * ENTRY_BYTES


def test_refuses_wrong_sizes_and_a_closed_tier(tmp_path):
    with pytest.raises(ValueError, match="holds no entry"):
        open_tier(tmp_path, capacity_bytes=SLOT_BYTES - 1)
    tier = open_tier(tmp_path)
    with pytest.raises(ValueError, match="bytes"):
        tier.put(digest(0), torch.zeros(ENTRY_BYTES + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        tier.put(digest(0), torch.zeros(2, ENTRY_BYTES, dtype=torch.uint8)[:, ::2])
    with pytest.raises(ValueError, match="digest"):
        tier.put(b"short", payload(digest(0)))
    with pytest.raises(RuntimeError, match="in use"):
        open_tier(tmp_path)
    tier.close()
    with pytest.raises(ValueError, match="closed"):
        tier.put(digest(0), payload(digest(0)))
    open_tier(tmp_path).close()  # the directory is free again


def test_evicts_least_recently_used_and_a_repeated_put_only_touches(tmp_path):
    a, b, c, d = (digest(n) for n in range(4))
    with open_tier(tmp_path, entries=2) as tier:
        tier.put(a, payload(a))
        tier.put(b, payload(b))
        assert reads_back(tier, a)
        tier.put(c, payload(c))
        assert a in tier and b not in tier and c in tier
        tier.put(a, payload(d))  # already there: touched, not rewritten
        tier.put(d, payload(d))
        assert reads_back(tier, a) and c not in tier and reads_back(tier, d)
        stats = tier.stats()
    assert (stats.writes, stats.evictions, stats.entries) == (4, 2, 2)


def test_discard(tmp_path):
    with open_tier(tmp_path) as tier:
        for n in range(3):
            tier.put(digest(n), payload(digest(n)))
        tier.discard(digest(1))
        tier.discard(digest(9))
        assert digest(1) not in tier and not reads_back(tier, digest(1))
    with open_tier(tmp_path) as tier:
        assert digest(1) not in tier and len(tier) == 2


def test_restart_keeps_entries_bytes_and_lru_order(tmp_path):
    keys = [digest(n) for n in range(4)]
    with open_tier(tmp_path, entries=4, extent_entries=3) as tier:
        for key in keys:
            tier.put(key, payload(key))
        assert reads_back(tier, keys[0])  # LRU order now 1, 2, 3, 0
    with open_tier(tmp_path, entries=4, extent_entries=3) as tier:
        assert len(tier) == 4 and tier.stats().dropped_corrupt == 0
        tier.put(digest(4), payload(digest(4)))
        tier.put(digest(5), payload(digest(5)))
        assert [key in tier for key in keys] == [True, False, False, True]
    with open_tier(tmp_path, entries=4, extent_entries=3) as tier:
        assert all(reads_back(tier, key) for key in (keys[0], keys[3], digest(4), digest(5)))


@pytest.mark.parametrize(
    "other", [{"fingerprint": bytes(32)}, {"entry_bytes": ENTRY_BYTES + 8}], ids=["fp", "size"]
)
def test_reopen_with_another_fingerprint_or_entry_size_drops_everything(tmp_path, other):
    stray = tmp_path / "notes.txt"
    stray.write_text("not the tier's")
    with open_tier(tmp_path, extent_entries=2) as tier:
        for n in range(5):
            tier.put(digest(n), payload(digest(n)))
    assert len(extents(tmp_path)) == 3
    with open_tier(tmp_path, **other) as tier:
        stats = tier.stats()
        assert (stats.entries, stats.dropped_foreign, stats.dropped_corrupt) == (0, 5, 0)
        assert extents(tmp_path) == []
        tier.put(digest(9), payload(digest(9), tier.entry_bytes))
    assert stray.read_text() == "not the tier's"
    with open_tier(tmp_path) as tier:  # the first kind is foreign in turn
        assert len(tier) == 0 and tier.stats().dropped_foreign == 1


def test_corrupt_payload_is_dropped_at_read(tmp_path):
    with open_tier(tmp_path, extent_entries=2) as tier:
        for n in range(4):
            tier.put(digest(n), payload(digest(n)))
    # slots are taken lowest first: entry 3 is slot 1 of the second extent
    flip_byte(extents(tmp_path)[1], SLOT_BYTES + HEADER_BYTES + 1234)
    with open_tier(tmp_path, extent_entries=2) as tier:
        assert len(tier) == 4  # payloads are checked at read, not at open
        assert not reads_back(tier, digest(3)) and digest(3) not in tier
        assert all(reads_back(tier, digest(n)) for n in range(3))
        assert tier.stats().dropped_corrupt == 1
    with open_tier(tmp_path, extent_entries=2) as tier:
        assert len(tier) == 3 and tier.stats().dropped_corrupt == 0


@pytest.mark.parametrize("offset", [0, 50, 90, 127], ids=["magic", "digest", "sequence", "crc"])
def test_corrupt_header_is_dropped_at_open(tmp_path, offset):
    with open_tier(tmp_path) as tier:
        for n in range(3):
            tier.put(digest(n), payload(digest(n)))
    flip_byte(extents(tmp_path)[0], SLOT_BYTES + offset)
    with open_tier(tmp_path) as tier:
        assert digest(1) not in tier and len(tier) == 2
        assert tier.stats().dropped_corrupt == 1
        assert reads_back(tier, digest(0)) and reads_back(tier, digest(2))
        tier.put(digest(1), payload(digest(1)))  # into the freed slot
    with open_tier(tmp_path) as tier:
        assert all(reads_back(tier, digest(n)) for n in range(3))
        assert tier.stats().dropped_corrupt == 0


def test_size_limit_and_reopening_smaller(tmp_path):
    capacity = 5 * SLOT_BYTES + SLOT_BYTES // 2
    with open_tier(tmp_path, capacity_bytes=capacity, extent_entries=2) as tier:
        assert tier.capacity_entries == 5
        for n in range(12):
            tier.put(digest(n), payload(digest(n)))
            assert extent_bytes(tmp_path) <= capacity
        # slots hold 10, 11, 7, 8, 9; the least recently used first: 10, 11, 7, 9, 8
        assert all(reads_back(tier, digest(n)) for n in (7, 9, 8))
    assert extent_bytes(tmp_path) <= capacity
    # 9 and 8 sit in slots 4 and 3, beyond the new capacity: they move below it
    with open_tier(tmp_path, entries=3, extent_entries=2) as tier:
        assert extent_bytes(tmp_path) <= 3 * SLOT_BYTES
        assert [digest(n) in tier for n in (10, 11, 7, 9, 8)] == [False, False, True, True, True]
        assert tier.stats().evictions == 2
        assert all(reads_back(tier, digest(n)) for n in (7, 9, 8))
    # another extent size moves entries between files the same way
    with open_tier(tmp_path, entries=3, extent_entries=1) as tier:
        assert len(tier) == 3 and len(extents(tmp_path)) == 3
        assert all(reads_back(tier, digest(n)) for n in (7, 9, 8))


def test_reader_thread_beside_puts_reads_only_whole_entries(tmp_path):
    keys = [digest(n) for n in range(12)]
    done = threading.Event()
    results = {"hit": 0, "miss": 0, "errors": []}

    def reader() -> None:
        rng = random.Random(1)
        try:
            while not done.is_set():
                key = rng.choice(keys)
                results["hit" if reads_back(tier, key) else "miss"] += 1
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            results["errors"].append(error)

    with open_tier(tmp_path, entries=4, extent_entries=3) as tier:
        thread = threading.Thread(target=reader)
        thread.start()
        rng = random.Random(2)
        deadline = time.monotonic() + 20
        for ops in itertools.count():
            if ops >= 400 and min(results["hit"], results["miss"]) >= 100:
                break
            assert time.monotonic() < deadline and not results["errors"]
            key = rng.choice(keys)
            if rng.random() < 0.1:
                tier.discard(key)
            else:
                tier.put(key, payload(key))
        done.set()
        thread.join()
        stats = tier.stats()
    assert results["errors"] == []
    assert stats.dropped_corrupt == 0 and stats.entries <= 4


def test_eviction_and_discard_wait_for_a_read_in_progress(tmp_path, monkeypatch):
    """A slot being read is neither reused nor zeroed until its read ends."""
    a, b, c = (digest(n) for n in range(3))
    inside, release = threading.Event(), threading.Event()
    real_preadv = disk_tier.os.preadv

    def slow_preadv(fd, buffers, offset):
        inside.set()
        release.wait()
        return real_preadv(fd, buffers, offset)

    with open_tier(tmp_path, entries=2) as tier:
        tier.put(a, payload(a))
        tier.put(b, payload(b))
        monkeypatch.setattr(disk_tier.os, "preadv", slow_preadv)
        result = []
        thread = threading.Thread(target=lambda: result.append(read(tier, a)))
        thread.start()
        try:
            assert inside.wait(5)
            tier.put(c, payload(c))  # a is the least recently used, but pinned: b goes
            assert a in tier and b not in tier
            tier.discard(a)  # its slot stays until the read ends
            tier.put(b, payload(b))  # so this one must evict c
            assert a not in tier and c not in tier and b in tier
        finally:
            release.set()
            thread.join()
        monkeypatch.undo()
        assert torch.equal(result[0], payload(a))
        tier.put(c, payload(c))  # into a's slot, freed by the read
        assert reads_back(tier, b) and reads_back(tier, c)
        assert tier.stats().dropped_corrupt == 0


# -- SIGKILL in the middle of writes ---------------------------------------------------

KILL_ENTRY_BYTES = 16_384
KILL_CAPACITY = 3
WRITE_PIECE = 2048

WRITER = r"""
import hashlib, importlib.util, os, random, sys, time
import torch

# the module alone: importing the package would load the whole engine (seconds)
spec = importlib.util.spec_from_file_location("disk_tier", sys.argv[1])
disk_tier = importlib.util.module_from_spec(spec)
sys.modules["disk_tier"] = disk_tier
spec.loader.exec_module(disk_tier)
directory, first, entry_bytes, capacity, piece = sys.argv[2:]
entry_bytes, capacity, piece = int(entry_bytes), int(capacity), int(piece)
sys.stdin.readline()  # go
tier = disk_tier.DiskTier(
    directory, capacity * disk_tier.slot_bytes_for(entry_bytes), entry_bytes,
    hashlib.sha256(b"model, dtype, format, block size, shapes").digest(), extent_entries=2,
)
real_pwrite = os.pwrite

def pwrite_in_pieces(fd, data, offset):
    # what the kernel may do too: take part of a write; then wait where the test kills
    written = real_pwrite(fd, memoryview(data)[:piece], offset)
    print("wrote", flush=True)
    time.sleep(0.002)
    return written

os.pwrite = pwrite_in_pieces
n = int(first)
while True:
    key = hashlib.sha256(b"block %d" % n).digest()
    data = random.Random(key).randbytes(entry_bytes)
    tier.put(key, torch.frombuffer(bytearray(data), dtype=torch.uint8))
    print("put", n, flush=True)
    n += 1
"""


def start_writer(directory: Path, first: int) -> subprocess.Popen:
    command = [sys.executable, "-c", WRITER, disk_tier.__file__, str(directory), str(first)]
    command += [str(KILL_ENTRY_BYTES), str(KILL_CAPACITY), str(WRITE_PIECE)]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def kill_after_writes(writer: subprocess.Popen, writes: int) -> int | None:
    """Let the writer go, SIGKILL it after ``writes`` pieces written; the last put done."""
    writer.stdin.write("go\n")
    writer.stdin.close()
    last_put = None
    for line in writer.stdout:
        if line.startswith("put"):
            last_put = int(line.split()[1])
        elif line == "wrote\n":
            writes -= 1
            if writes == 0:
                writer.send_signal(signal.SIGKILL)
    assert writer.wait() == -signal.SIGKILL
    return last_put


def test_sigkill_during_puts_loses_at_most_the_entry_in_flight(tmp_path):
    """Kill a writer inside its writes again and again; after each kill every entry
    that was put is there bit for bit, but the one in flight and the one it evicted."""
    # all start at once: their imports overlap the rounds before theirs
    writers = [start_writer(tmp_path, 1000 * round_) for round_ in range(3)]
    rng = random.Random(0)
    model: list[int] = []  # entries present, least recently used first
    try:
        for round_, writer in enumerate(writers):
            first = 1000 * round_
            last_put = kill_after_writes(writer, rng.randint(15, 60))
            assert last_put is not None, "killed before a whole put: kill later"
            for n in range(first, last_put + 1):
                model.append(n)
                del model[:-KILL_CAPACITY]
            in_flight = last_put + 1
            evicting = model[:1] if len(model) == KILL_CAPACITY else []
            reopened = open_tier(
                tmp_path, KILL_CAPACITY, entry_bytes=KILL_ENTRY_BYTES, extent_entries=2
            )
            with reopened as tier:
                present = [n for n in [*model, in_flight] if digest(n) in tier]
                assert len(tier) == len(present)
                assert set(model) - set(evicting) <= set(present)
                assert all(reads_back(tier, digest(n)) for n in present)
                assert tier.stats().dropped_corrupt == 0
            model = present
    finally:
        for writer in writers:
            writer.kill()
            writer.wait()


# -- speed, by hand --------------------------------------------------------------------


def main(directory: Path) -> None:
    """Put and read 256 entries of the default model's block (16 tokens, bfloat16), in
    MB/s: puts into new files and, in the full tier, into evicted slots; reads from the
    page cache and from the disk."""
    import os

    entries, entry_bytes = 256, 368_640
    blocks = [torch.randint(0, 256, (entry_bytes,), dtype=torch.uint8) for _ in range(entries)]
    outs = [torch.empty(entry_bytes, dtype=torch.uint8) for _ in range(entries)]
    megabytes = entries * entry_bytes / 1e6

    def timed(label: str, call, keys: list[bytes], tensors: list[torch.Tensor]) -> None:
        start = time.perf_counter()
        for key, tensor in zip(keys, tensors, strict=True):
            call(key, tensor)
        print(f"{label:24s} {megabytes / (time.perf_counter() - start):6.0f} MB/s")

    def read(key: bytes, out: torch.Tensor) -> None:
        assert tier.read_into(key, out)

    capacity = entries * slot_bytes_for(entry_bytes)
    with DiskTier(directory, capacity, entry_bytes, FINGERPRINT) as tier:
        timed("put, new files", tier.put, [digest(n) for n in range(entries)], blocks)
        keys = [digest(entries + n) for n in range(entries)]
        timed("put, evicting", tier.put, keys, blocks)
        timed("read_into, page cache", read, keys, outs)
        os.sync()
        for path in extents(directory):
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        timed("read_into, disk", read, keys, outs)
    assert all(torch.equal(out, block) for out, block in zip(outs, blocks, strict=True))
    for path in extents(directory):
        path.unlink()


if __name__ == "__main__":
    import tempfile

    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))
