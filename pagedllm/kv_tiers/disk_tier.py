"""The disk tier: fixed-size KV block payloads in checksummed slots of extent files.

A :class:`DiskTier` maps a block's content digest (:attr:`BlockKey.digest
<pagedllm.kv.prefix_hash.BlockKey.digest>`, 32 bytes) to a payload of ``entry_bytes``
bytes, in a directory of its own files, and gives the same bytes back after a restart.

Layout. The tier's slots are numbered ``0 .. capacity_entries - 1``; slot ``s`` lives in
extent file ``kvtier-v1-<entry_bytes>-<s // extent_entries, 6 digits>.extent`` at byte
``(s % extent_entries) * slot_bytes``. A slot is one header (128 bytes) and the payload
right after it, rounded up to whole 4 KiB pages: an entry is one sequential run, and a
header never straddles a page. Extents grow as their slots are first written, so the
directory holds at most ``capacity_entries * slot_bytes <= capacity_bytes`` bytes of
extents. Other files in the directory are left alone, apart from ``kvtier.lock``, which
keeps a second tier (in this process or another) off the same directory.

Entry header, little-endian, 128 bytes::

    offset size
       0    8  magic b"PGKVTIER"
       8    4  format version (uint32, 1)
      12   32  fingerprint: model, dtype, K/V format, block size, shapes (the caller's)
      44   32  digest of the block
      76    8  payload length in bytes (uint64, = entry_bytes)
      84    8  write sequence number (uint64, increasing across restarts; the LRU order)
      92    4  CRC-32 (zlib.crc32) of the payload
      96   28  zero
     124    4  CRC-32 of bytes 0 .. 123 of this header

An all-zero header marks a free slot. CRC-32 guards against torn writes and media
errors, not against someone forging entries in the directory; it runs at 2.6 GB/s where
SHA-256 runs at 1 GB/s.

Write order. ``put`` zeroes the slot's header, writes the payload, then writes the
header: a valid header is only ever on disk in front of the complete payload it
describes. SIGKILL at any point loses at most the entry being written (and the entry it
was evicting). A header lies within one page, so a single write puts it there whole; its
checksum catches it if ever not. Nothing is fsynced: data the kernel had accepted
survives the process, not a power loss or a kernel crash (a torn entry is then caught
by its checksums at open or read). ``close`` rewrites the headers whose use since their
write changed their LRU place, with new sequence numbers in LRU order; after a kill the
order falls back to the order of writes.

Open. The headers of every slot (not the payloads) are read to rebuild the index. A
header that fails its checksum is dropped as corrupt; one of another fingerprint, entry
size or version, and every extent named for another entry size or version, as foreign;
of two entries with one digest the newer stays. Dropped headers are zeroed. If the
entries outrun the capacity, the least recently written ones are evicted, entries in
slots beyond the capacity move into free slots below it, and each extent is cut after
its last entry (or removed with none). Payload checksums are checked by ``read_into``.

Threads. A lock guards the index, and is never held across file I/O. ``put`` and
``discard`` are serialized by a second lock, so writes run one at a time (a reader
never waits for one). ``read_into`` pins its slot for the length of its read: eviction
skips pinned entries (an entry being read is about to become the most recently used
anyway), and a discarded or corrupt entry's slot is freed by its last reader. A ``put``
waits only when every entry is pinned, until a read ends.
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple

import torch

FORMAT_VERSION = 1
MAGIC = b"PGKVTIER"
_HEADER = struct.Struct("<8sI32s32sQQI28xI")
HEADER_BYTES = _HEADER.size  # 128
_ZERO_HEADER = bytes(HEADER_BYTES)
PAGE_BYTES = 4096
EXTENT_TARGET_BYTES = 64 << 20
LOCK_NAME = "kvtier.lock"
_EXTENT_NAME = re.compile(r"kvtier-v(\d+)-(\d+)-(\d+)\.extent")


def slot_bytes_for(entry_bytes: int) -> int:
    """Bytes one entry takes on disk: header and payload, rounded up to whole pages."""
    return -(-(HEADER_BYTES + entry_bytes) // PAGE_BYTES) * PAGE_BYTES


def capacity_entries_for(capacity_bytes: int, entry_bytes: int) -> int:
    """Entries of ``entry_bytes`` a directory of at most ``capacity_bytes`` holds."""
    return capacity_bytes // slot_bytes_for(entry_bytes)


@dataclass(frozen=True)
class DiskTierStats:
    """Counters since open. Entries are counted in entries, bytes in payload bytes.

    ``writes``/``bytes_written``: puts that wrote an entry; ``reads``/``bytes_read``:
    successful ``read_into`` calls; ``evictions``: entries evicted to make room (at open
    too); ``dropped_corrupt``: entries dropped for a bad header (at open) or payload (at
    read); ``dropped_foreign``: entries of another fingerprint, entry size or version.
    """

    capacity_entries: int
    entries: int
    bytes_written: int
    bytes_read: int
    writes: int
    reads: int
    evictions: int
    dropped_corrupt: int
    dropped_foreign: int


_COUNTERS = tuple(f.name for f in fields(DiskTierStats))[2:]  # after the two sizes


class _Entry(NamedTuple):
    slot: int
    sequence: int
    payload_crc: int


class _Found(NamedTuple):
    """A valid header found at open, at slot ``index`` of extent ``extent``."""

    extent: int
    index: int
    digest: bytes
    sequence: int
    payload_crc: int


def _bytes_of(tensor: torch.Tensor, entry_bytes: int) -> memoryview:
    """The bytes of a contiguous CPU tensor of ``entry_bytes`` bytes, without a copy."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("the tier reads and writes contiguous CPU tensors")
    if tensor.nbytes != entry_bytes:
        raise ValueError(
            f"a tensor of {tensor.nbytes} bytes, the tier's entries hold {entry_bytes}"
        )
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _write_file(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        _pwrite_all(fd, data, offset)
    finally:
        os.close(fd)


class DiskTier:
    """At most ``capacity_bytes`` of ``entry_bytes``-byte entries in ``directory``.

    ``fingerprint`` (32 bytes) names everything the payload bytes depend on besides the
    digest; entries of another fingerprint or entry size found at open are foreign.
    ``extent_entries`` is the number of slots per extent file (default: about 64 MiB of
    them). Call ``close`` after the last other call has returned.
    """

    def __init__(
        self,
        directory: str | Path,
        capacity_bytes: int,
        entry_bytes: int,
        fingerprint: bytes,
        extent_entries: int | None = None,
    ) -> None:
        if entry_bytes <= 0:
            raise ValueError(f"entry_bytes must be positive, got {entry_bytes}")
        if len(fingerprint) != 32:
            raise ValueError(f"the fingerprint is 32 bytes, got {len(fingerprint)}")
        self.entry_bytes = entry_bytes
        self.slot_bytes = slot_bytes_for(entry_bytes)
        self.capacity_entries = capacity_entries_for(capacity_bytes, entry_bytes)
        if self.capacity_entries < 1:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} holds no entry: one takes {self.slot_bytes} "
                f"bytes ({HEADER_BYTES}-byte header and {entry_bytes}-byte payload, in pages)"
            )
        if extent_entries is None:
            extent_entries = max(1, round(EXTENT_TARGET_BYTES / self.slot_bytes))
        if extent_entries < 1:
            raise ValueError(f"extent_entries must be positive, got {extent_entries}")
        self.extent_entries = extent_entries
        self.fingerprint = fingerprint
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.directory / LOCK_NAME, "a+b")  # noqa: SIM115
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise RuntimeError(f"{self.directory} is in use by another DiskTier") from None

        self._lock = threading.Condition()
        self._write_lock = threading.Lock()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._free: list[int] = []  # slots below _fresh that hold no entry
        self._fresh = 0  # slots from here on were never written since open
        self._pins: dict[int, int] = {}  # slot -> reads in progress
        self._doomed: set[int] = set()  # slots out of the index, freed when unpinned
        self._next_sequence = 1
        self._closed = False
        self._counts = dict.fromkeys(_COUNTERS, 0)
        try:
            self._open_directory()
        except BaseException:
            self._lock_file.close()
            raise

    # -- public interface --------------------------------------------------------------

    def __contains__(self, digest: bytes) -> bool:
        with self._lock:
            return digest in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def put(self, digest: bytes, payload: torch.Tensor) -> None:
        """Store ``payload`` (``entry_bytes`` bytes) under ``digest``, evicting the least
        recently used entry if the tier is full; an entry already there is only touched."""
        if len(digest) != 32:
            raise ValueError(f"a digest is 32 bytes, got {len(digest)}")
        data = _bytes_of(payload, self.entry_bytes)
        with self._write_lock:
            with self._lock:
                self._check_open()
                if digest in self._index:
                    self._index.move_to_end(digest)
                    return
                slot = self._take_slot()
                sequence = self._next_sequence
                self._next_sequence += 1
            crc = zlib.crc32(data)
            try:
                self._write_slot(slot, self._header(digest, sequence, crc), data)
            except BaseException:
                self._release(slot)
                raise
            with self._lock:
                self._index[digest] = _Entry(slot, sequence, crc)
                self._counts["writes"] += 1
                self._counts["bytes_written"] += self.entry_bytes

    def read_into(self, digest: bytes, out: torch.Tensor) -> bool:
        """Copy the entry's payload into ``out`` (``entry_bytes`` bytes) and mark it most
        recently used. False for a missing entry, or a torn or corrupt one (which is
        deleted); on False the bytes of ``out`` are unspecified."""
        buffer = _bytes_of(out, self.entry_bytes)
        with self._lock:
            self._check_open()
            entry = self._index.get(digest)
            if entry is None:
                return False
            self._pins[entry.slot] = self._pins.get(entry.slot, 0) + 1
        ok = False
        try:
            header = bytearray(HEADER_BYTES)
            ok = (
                self._read_slot(entry.slot, header, buffer)
                and header == self._header(digest, entry.sequence, entry.payload_crc)
                and zlib.crc32(buffer) == entry.payload_crc
            )
        finally:
            self._unpin(digest, entry, ok)
        return ok

    def discard(self, digest: bytes) -> None:
        """Delete the entry of ``digest``, if any."""
        with self._write_lock:
            with self._lock:
                self._check_open()
                entry = self._index.pop(digest, None)
                if entry is None:
                    return
                if entry.slot in self._pins:
                    self._doomed.add(entry.slot)
                    return
            self._release(entry.slot)

    def clear(self) -> int:
        """Delete every entry (a prefix-cache reset); the entries deleted."""
        with self._lock:
            digests = list(self._index)
        for digest in digests:
            self.discard(digest)
        return len(digests)

    def stats(self) -> DiskTierStats:
        with self._lock:
            return DiskTierStats(
                capacity_entries=self.capacity_entries, entries=len(self._index), **self._counts
            )

    def close(self) -> None:
        """Wait for reads in progress, write the LRU order into the headers and release
        the directory; it opens again with every entry. Idempotent."""
        with self._write_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                while self._pins or self._doomed:
                    self._lock.wait()
            # puts, reads and discards now refuse: the slots are this thread's alone
            last = 0
            for digest, entry in self._index.items():
                if entry.sequence < last:
                    entry = entry._replace(sequence=self._next_sequence)
                    self._next_sequence += 1
                    self._index[digest] = entry
                    header = self._header(digest, entry.sequence, entry.payload_crc)
                    self._write_at(entry.slot, header)
                last = entry.sequence
            self._lock_file.close()

    # -- slots -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the DiskTier is closed")

    def _take_slot(self) -> int:
        """A slot for a new entry: a free one, else the least recently used unpinned
        entry's (evicted). Called with the lock held; waits while every entry is pinned."""
        while True:
            slot = self._unused_slot()
            if slot is not None:
                return slot
            victim = next((d for d, e in self._index.items() if e.slot not in self._pins), None)
            if victim is not None:
                self._counts["evictions"] += 1
                return self._index.pop(victim).slot
            self._lock.wait()

    def _unused_slot(self) -> int | None:
        """A slot holding no entry: a freed one, else the lowest never written, else None."""
        if self._free:
            return self._free.pop()
        if self._fresh == self.capacity_entries:
            return None
        self._fresh += 1
        return self._fresh - 1

    def _unpin(self, digest: bytes, entry: _Entry, ok: bool) -> None:
        with self._lock:
            pins = self._pins.pop(entry.slot) - 1
            if pins:
                self._pins[entry.slot] = pins
            current = self._index.get(digest) is entry
            if ok:
                self._counts["reads"] += 1
                self._counts["bytes_read"] += self.entry_bytes
                if current:
                    self._index.move_to_end(digest)
            elif current:
                del self._index[digest]
                self._counts["dropped_corrupt"] += 1
                self._doomed.add(entry.slot)
            release = not pins and entry.slot in self._doomed
        if release:
            self._release(entry.slot)

    def _release(self, slot: int) -> None:
        """Zero the header of ``slot`` (out of the index, unpinned) and free it."""
        try:
            self._write_at(slot, _ZERO_HEADER)
        finally:
            with self._lock:
                self._doomed.discard(slot)
                self._free.append(slot)
                self._lock.notify_all()

    def _header(self, digest: bytes, sequence: int, payload_crc: int) -> bytes:
        identity = (MAGIC, FORMAT_VERSION, self.fingerprint, digest, self.entry_bytes)
        head = _HEADER.pack(*identity, sequence, payload_crc, 0)[:-4]
        return head + struct.pack("<I", zlib.crc32(head))

    def _extent_path(self, extent: int) -> Path:
        name = f"kvtier-v{FORMAT_VERSION}-{self.entry_bytes}-{extent:06d}.extent"
        return self.directory / name

    def _locate(self, slot: int) -> tuple[Path, int]:
        extent, index = divmod(slot, self.extent_entries)
        return self._extent_path(extent), index * self.slot_bytes

    def _write_at(self, slot: int, data: bytes) -> None:
        _write_file(*self._locate(slot), data)

    def _write_slot(self, slot: int, header: bytes, payload: memoryview) -> None:
        """Header zeroed, payload, header: the order that survives a kill at any point."""
        path, offset = self._locate(slot)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            _pwrite_all(fd, _ZERO_HEADER, offset)
            _pwrite_all(fd, payload, offset + HEADER_BYTES)
            _pwrite_all(fd, header, offset)
        finally:
            os.close(fd)

    def _read_slot(self, slot: int, header: bytearray, payload: memoryview) -> bool:
        """Header and payload of ``slot`` in one read; False if the extent ends short."""
        path, offset = self._locate(slot)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            return os.preadv(fd, [header, payload], offset) == HEADER_BYTES + self.entry_bytes
        finally:
            os.close(fd)

    # -- open --------------------------------------------------------------------------

    def _open_directory(self) -> None:
        found: dict[bytes, _Found] = {}
        extents: dict[int, Path] = {}
        for path in sorted(self.directory.iterdir()):
            match = _EXTENT_NAME.fullmatch(path.name)
            if match is None:
                continue
            version, entry_bytes, extent = (int(group) for group in match.groups())
            if version != FORMAT_VERSION or entry_bytes != self.entry_bytes:
                self._drop_foreign_extent(path, version, entry_bytes)
                continue
            extents[extent] = path
            for entry in self._scan_extent(path, extent):
                self._next_sequence = max(self._next_sequence, entry.sequence + 1)
                other = found.get(entry.digest)
                if other is not None:  # a move at an earlier open was cut short
                    other, entry = sorted((other, entry), key=lambda found: found.sequence)
                    self._zero_found(other)
                found[entry.digest] = entry

        entries = sorted(found.values(), key=lambda entry: entry.sequence)
        surplus = max(0, len(entries) - self.capacity_entries)
        for entry in entries[:surplus]:
            self._zero_found(entry)
        self._counts["evictions"] += surplus
        kept = entries[surplus:]

        def slot_of(entry: _Found) -> int | None:
            slot = entry.extent * self.extent_entries + entry.index
            in_plan = entry.index < self.extent_entries and slot < self.capacity_entries
            return slot if in_plan else None

        used = {slot_of(entry) for entry in kept}
        self._fresh = 1 + max((slot for slot in used if slot is not None), default=-1)
        self._free = [slot for slot in range(self._fresh) if slot not in used]
        for entry in kept:
            slot = slot_of(entry)
            if slot is None:
                slot = self._unused_slot()
                assert slot is not None  # as len(kept) <= capacity_entries
                self._move(entry, slot)
            self._index[entry.digest] = _Entry(slot, entry.sequence, entry.payload_crc)

        last_index: dict[int, int] = {}
        for entry in self._index.values():
            extent, index = divmod(entry.slot, self.extent_entries)
            last_index[extent] = max(last_index.get(extent, 0), index)
        for extent, path in extents.items():
            if extent in last_index:
                os.truncate(path, (last_index[extent] + 1) * self.slot_bytes)
            else:
                path.unlink()

    def _scan_extent(self, path: Path, extent: int) -> list[_Found]:
        """The valid entries of one of this tier's extents; bad headers zeroed, counted."""
        entries = []
        with open(path, "r+b") as file:
            for index, raw in _headers(file.fileno(), self.entry_bytes):
                fields = _valid_fields(raw)
                if fields is None:
                    self._counts["dropped_corrupt"] += 1
                elif fields[:3] != (FORMAT_VERSION, self.fingerprint, self.entry_bytes):
                    self._counts["dropped_foreign"] += 1
                else:
                    digest, sequence, payload_crc = fields[3:]
                    entries.append(_Found(extent, index, digest, sequence, payload_crc))
                    continue
                _pwrite_all(file.fileno(), _ZERO_HEADER, index * self.slot_bytes)
        return entries

    def _drop_foreign_extent(self, path: Path, version: int, entry_bytes: int) -> None:
        """Delete an extent of another entry size or version, counting the entries of one
        of this version (another version's layout is unknown)."""
        if version == FORMAT_VERSION:
            with open(path, "rb") as file:
                headers = _headers(file.fileno(), entry_bytes)
                self._counts["dropped_foreign"] += sum(
                    _valid_fields(raw) is not None for _, raw in headers
                )
        path.unlink()

    def _zero_found(self, entry: _Found) -> None:
        path = self._extent_path(entry.extent)
        _write_file(path, entry.index * self.slot_bytes, _ZERO_HEADER)

    def _move(self, entry: _Found, slot: int) -> None:
        """Copy an entry found beyond the capacity, header unchanged, into ``slot``."""
        fd = os.open(self._extent_path(entry.extent), os.O_RDONLY)
        try:
            raw = os.pread(fd, HEADER_BYTES + self.entry_bytes, entry.index * self.slot_bytes)
        finally:
            os.close(fd)
        self._write_slot(slot, raw[:HEADER_BYTES], memoryview(raw)[HEADER_BYTES:])


def _headers(fd: int, entry_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(slot index, header) of each non-zero header of an extent of ``entry_bytes``
    entries whose payload the file holds whole (a put may leave the last slot short)."""
    slot_bytes = slot_bytes_for(entry_bytes)
    complete = (os.fstat(fd).st_size + slot_bytes - HEADER_BYTES - entry_bytes) // slot_bytes
    for index in range(complete):
        raw = os.pread(fd, HEADER_BYTES, index * slot_bytes)
        if raw != _ZERO_HEADER:
            yield index, raw


def _valid_fields(raw: bytes) -> tuple[int, bytes, int, bytes, int, int] | None:
    """(version, fingerprint, payload length, digest, sequence, payload CRC) of a header
    with the magic and a right checksum, else None."""
    magic, version, fingerprint, digest, length, sequence, payload_crc, crc = _HEADER.unpack(raw)
    if magic != MAGIC or zlib.crc32(raw[:-4]) != crc:
        return None
    return version, fingerprint, length, digest, sequence, payload_crc
