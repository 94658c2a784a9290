"""Same-host fast path: tensor bytes in shared-memory files that the receiver maps instead of reading a stream.

The sender owns its segments, `/dev/shm/shardtrain-<pid>-<id>`, and reuses them: tmpfs pages that
were written once need no page faults again, so after the first transfer a send is one copy at
memory speed, and the receiver maps the pages (MAP_POPULATE) and uses them as the tensor's storage
with no copy at all. A segment's first bytes say whose turn it is: the sender marks it busy and
bumps its generation before the handle goes out; the receiver marks it free when the last view of
the tensor it built is gone (a weakref finalizer on the mapped view). A segment that is busy is
never written; a handle whose generation does not match the segment is refused.

Cleanup: a sender unlinks its segments when it closes, on normal exit, and whenever a segment has
been busy too long (its receiver died holding it); a receiver's mapping survives the unlink.
Segments of a process that was SIGKILLed are swept by `sweep()`, which every shardtrain service and
the SDK's local cluster run, at start and at close: a segment whose creator pid is gone is removed.
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import secrets
import struct
import threading
import time
import weakref

import torch

from shardtrain.errors import DataLoss, InvalidArgument

DIRECTORY = "/dev/shm"
_NAME = re.compile(r"shardtrain-(\d+)-([0-9a-f]{16})")
_MAGIC = b"STSEG001"
_HEADER = struct.Struct("<8sqq")  # magic, generation, state
_FREE, _BUSY = 0, 1
DATA_OFFSET = 4096  # page aligned, so any dtype's view of the data is aligned
# Below this size a tensor rides in the gRPC message itself: one small message costs less than a
# segment's bookkeeping (bench/transport.py: the crossover on this machine lies near 64 KiB).
MIN_BYTES = 64 << 10
MAX_SEGMENTS = 64      # per sender; when all are busy, tensors go by stream instead
STALE_AFTER_S = 600.0  # a segment busy this long belongs to a receiver that died: unlink, never reuse


def available() -> bool:
    """Whether this host has a tmpfs at /dev/shm to put segments in."""
    return os.path.isdir(DIRECTORY) and os.access(DIRECTORY, os.W_OK)


def _check_path(path: str) -> None:
    if os.path.dirname(path) != DIRECTORY or not _NAME.fullmatch(os.path.basename(path)):
        raise InvalidArgument(f"shared segment {path!r} is not a shardtrain segment "
                              f"(expected {DIRECTORY}/shardtrain-<pid>-<16 hex digits>)")


def _new_path() -> str:
    return f"{DIRECTORY}/shardtrain-{os.getpid()}-{secrets.token_hex(8)}"


class _Segment:
    """One sender-owned file, mapped for writing."""

    def __init__(self, capacity: int):
        self.path = _new_path()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, DATA_OFFSET + capacity)
            self.map = mmap.mmap(fd, DATA_OFFSET + capacity)
        finally:
            os.close(fd)
        self.capacity, self.generation, self.busy_since = capacity, 0, 0.0
        _HEADER.pack_into(self.map, 0, _MAGIC, 0, _FREE)

    def is_free(self) -> bool:
        return _HEADER.unpack_from(self.map, 0)[2] == _FREE

    def claim(self) -> int:
        self.generation += 1
        self.busy_since = time.monotonic()
        _HEADER.pack_into(self.map, 0, _MAGIC, self.generation, _BUSY)
        return self.generation

    def destroy(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        try:
            self.map.close()
        except BufferError:  # a copy into it is still running (closing at exit); the unlink is what matters
            pass


class SegmentPool:
    """A sender's reusable segments; `put` copies a tensor's bytes into a free one and says where."""

    def __init__(self, max_segments: int = MAX_SEGMENTS):
        self._segments: list[_Segment] = []
        self._max = max_segments
        self._lock = threading.Lock()
        _live_pools.add(self)

    def put(self, flat: torch.Tensor) -> tuple[str, int, int] | None:
        """(path, offset, generation) of a segment now holding `flat`'s bytes, or None when all are busy."""
        with self._lock:
            segment = self._free_segment(flat.numel())
            if segment is None:
                return None
            generation = segment.claim()
        target = torch.frombuffer(segment.map, dtype=torch.uint8, count=flat.numel(), offset=DATA_OFFSET)
        target.copy_(flat)
        return segment.path, DATA_OFFSET, generation

    def _free_segment(self, nbytes: int) -> _Segment | None:
        self._drop_stale()
        fits = [s for s in self._segments if s.capacity >= nbytes and s.is_free()]
        if fits:
            return min(fits, key=lambda s: s.capacity)
        if len(self._segments) >= self._max:
            return None
        segment = _Segment(max(nbytes, MIN_BYTES))
        self._segments.append(segment)
        return segment

    def _drop_stale(self) -> None:
        now = time.monotonic()
        for segment in [s for s in self._segments if not s.is_free() and now - s.busy_since > STALE_AFTER_S]:
            self._segments.remove(segment)
            segment.destroy()

    def close(self) -> None:
        """Unlinks every segment; receivers keep the mappings they hold."""
        with self._lock:
            for segment in self._segments:
                segment.destroy()
            self._segments.clear()


_live_pools: weakref.WeakSet[SegmentPool] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for pool in list(_live_pools):
        pool.close()


def open_segment(path: str, offset: int, generation: int, nbytes: int) -> torch.Tensor:
    """The `nbytes` at `offset` of a peer's segment as a uint8 tensor sharing its pages (no copy).

    The segment is handed back (marked free) when the last view of the returned tensor is gone.
    """
    _check_path(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as error:
        raise DataLoss(f"shared segment {path} cannot be opened: {error.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if offset < DATA_OFFSET or offset + nbytes > size:
            raise InvalidArgument(f"shared segment {path}: bytes {offset}..{offset + nbytes} lie outside "
                                  f"its data area {DATA_OFFSET}..{size}")
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
    magic, found, state = _HEADER.unpack_from(mapping, 0)
    if magic != _MAGIC or found != generation or state != _BUSY:
        mapping.close()
        raise DataLoss(f"shared segment {path}: generation {found} (state {state}) does not match the "
                       f"handle's {generation}: the sender reused or abandoned it")
    view = memoryview(mapping)[offset:offset + nbytes]
    weakref.finalize(view, _hand_back, mapping, generation)
    return torch.frombuffer(view, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)


def _hand_back(mapping: mmap.mmap, generation: int) -> None:
    """Marks the segment free for its sender, unless the sender has moved on since."""
    if _HEADER.unpack_from(mapping, 0)[1] == generation:
        _HEADER.pack_into(mapping, 0, _MAGIC, generation, _FREE)
    mapping.close()


def write_probe() -> tuple[str, bytes]:
    """A fresh segment holding a random token, for a peer to read back (ProbeSharedMemory)."""
    path, token = _new_path(), secrets.token_bytes(16)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, token)
    finally:
        os.close(fd)
    return path, token


def read_probe(path: str) -> bytes:
    """The token in a peer's probe segment; empty when this process cannot open it (another host)."""
    _check_path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return b""
    try:
        return os.read(fd, 16)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    """Unlinks a segment this process made, if it is still there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def sweep() -> list[str]:
    """Removes the segments of shardtrain processes that no longer exist; returns their paths."""
    removed = []
    for name in os.listdir(DIRECTORY) if available() else []:
        match = _NAME.fullmatch(name)
        if match and not process_alive(int(match.group(1))):
            remove(f"{DIRECTORY}/{name}")
            removed.append(f"{DIRECTORY}/{name}")
    return removed


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
