"""Same-host fast path: tensor bytes in shared-memory files that the receiver maps instead of reading a stream.

The sender owns its segments, `/dev/shm/shardtrain-<pid>-<id>`, and reuses them: tmpfs pages that
were written once need no page faults again, so after the first transfer a send is one copy at
memory speed, and the receiver maps the pages (MAP_POPULATE, once per segment: it keeps the mapping
for the next tensor, see Mappings) and uses them as the tensor's storage with no copy at all. A
segment's first bytes say whose turn it is: the sender marks it busy and bumps its generation before
the handle goes out; the receiver marks it free when the last view of the tensor it built is gone (a
weakref finalizer on the mapped view). A segment that is busy is never written; a handle whose
generation does not match the segment is refused.

Cleanup: a sender unlinks its segments when it closes, on normal exit, and whenever a segment has
been busy too long (its receiver died holding it); a receiver's mapping survives the unlink (an idle
one for up to KEEP_SECONDS).
Segments of a process that was SIGKILLed are swept by `sweep()`, which every shardtrain service and
the SDK's local cluster run, at start and at close: a segment whose creator pid is gone is removed.
"""

from __future__ import annotations

import atexit
import logging
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
# segment's bookkeeping (`python -m bench.local_items` finds the crossover; docs/performance.md).
MIN_BYTES = 64 << 10
MAX_SEGMENTS = 64      # per sender; when all are busy, tensors go by stream instead
STALE_AFTER_S = 600.0  # a segment busy this long belongs to a receiver that died: unlink, never reuse
FULL_RETRY_S = 10.0    # after /dev/shm had no room, tensors go by stream this long before a segment is tried again

log = logging.getLogger("shardtrain.shm")


def available() -> bool:
    """Whether this host has a tmpfs at /dev/shm to put segments in."""
    return os.path.isdir(DIRECTORY) and os.access(DIRECTORY, os.W_OK)


def _check_path(path: str) -> None:
    if os.path.dirname(path) != DIRECTORY or not _NAME.fullmatch(os.path.basename(path)):
        raise InvalidArgument(f"shared segment {path!r} is not a shardtrain segment "
                              f"(expected {DIRECTORY}/shardtrain-<pid>-<16 hex digits>)")


def _path(pid: int, number: int) -> str:
    return f"{DIRECTORY}/shardtrain-{pid}-{number:016x}"


def _new_path() -> str:
    return _path(os.getpid(), secrets.randbits(64))


class _Segment:
    """One sender-owned file, mapped for writing.

    Its pages are reserved when it is made (posix_fallocate): a file that was only sized would take
    its pages at first write, and a full tmpfs answers that write with SIGBUS, which kills the process.
    OSError (ENOSPC) here instead, with nothing left behind.
    """

    def __init__(self, capacity: int):
        self.path = _path(os.getpid(), secrets.randbits(64))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, DATA_OFFSET + capacity)
            self.map = mmap.mmap(fd, DATA_OFFSET + capacity)
        except OSError:
            os.unlink(self.path)
            raise
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
        self._full_until = 0.0  # monotonic time before which no new segment is tried (/dev/shm was full)
        self._lock = threading.Lock()
        _live_pools.add(self)

    def put(self, flat: torch.Tensor) -> tuple[str, int, int] | None:
        """(path, offset, generation) of a segment now holding `flat`'s bytes, or None when all are busy."""
        placed = self._place(flat)
        return None if placed is None else (placed[0].path, DATA_OFFSET, placed[1])

    def _place(self, flat: torch.Tensor) -> tuple[_Segment, int] | None:
        with self._lock:
            segment = self._free_segment(flat.numel())
            if segment is None:
                return None
            generation = segment.claim()
        target = torch.frombuffer(segment.map, dtype=torch.uint8, count=flat.numel(), offset=DATA_OFFSET)
        target.copy_(flat)
        return segment, generation

    def _free_segment(self, nbytes: int) -> _Segment | None:
        self._drop_stale()
        fits = [s for s in self._segments if s.capacity >= nbytes and s.is_free()]
        if fits:
            return min(fits, key=lambda s: s.capacity)
        if len(self._segments) >= self._max or time.monotonic() < self._full_until:
            return None
        try:
            segment = _Segment(max(nbytes, MIN_BYTES))
        except OSError as error:
            self._full_until = time.monotonic() + FULL_RETRY_S
            log.warning("no room for a %d-byte shared segment in %s (%s): tensors go by stream for %g s",
                        max(nbytes, MIN_BYTES) + DATA_OFFSET, DIRECTORY, error.strerror, FULL_RETRY_S)
            return None
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
    return _RECEIVED.view(path, offset, generation, nbytes)


# Idle mappings a receiver keeps (none of its tensors uses them), in bytes and in time.
KEEP_BYTES = 256 << 20
KEEP_SECONDS = 30.0


class _Mapped:
    def __init__(self, mapping: mmap.mmap):
        self.mapping = mapping
        self.views: dict[int, int] = {}  # tensors built on it that are still alive, by the generation they read
        self.idle_since = time.monotonic()


class Mappings:
    """A receiver's mappings of its peers' segments, kept open for the next tensor in the same segment.

    A sender reuses a few segments over and over, so a receiver that kept each mapping open maps each
    segment once. Mapping one takes open, fstat and mmap, then munmap once its tensor is gone, which
    costs more than the rest of a small tensor's round trip through a segment. Bounded, because a
    mapping keeps its pages even after the sender unlinked the file (when its pool closed): mappings
    no tensor uses are closed, least recently used first, beyond `keep_bytes`, and once idle for
    `keep_seconds` (checked whenever a tensor is received or handed back).
    """

    def __init__(self, keep_bytes: int = KEEP_BYTES, keep_seconds: float = KEEP_SECONDS):
        self._mapped: dict[str, _Mapped] = {}   # in order of last use, oldest first
        self._keep_bytes, self._keep_seconds = keep_bytes, keep_seconds
        self._lock = threading.RLock()  # a tensor's finalizer can run anywhere, this method included

    def __len__(self) -> int:
        return len(self._mapped)

    def view(self, path: str, offset: int, generation: int, nbytes: int) -> torch.Tensor:
        """As open_segment (whose checks of `path` come first)."""
        with self._lock:
            mapped = self._mapped.pop(path, None) or _Mapped(_map(path))
            self._mapped[path] = mapped  # the most recently used now
            mapping = mapped.mapping
            if offset < DATA_OFFSET or offset + nbytes > len(mapping):
                raise InvalidArgument(f"shared segment {path}: bytes {offset}..{offset + nbytes} lie outside "
                                      f"its data area {DATA_OFFSET}..{len(mapping)}")
            magic, found, state = _HEADER.unpack_from(mapping, 0)
            if magic != _MAGIC or found != generation or state != _BUSY:
                raise DataLoss(f"shared segment {path}: generation {found} (state {state}) does not match the "
                               f"handle's {generation}: the sender reused or abandoned it")
            view = memoryview(mapping)[offset:offset + nbytes]
            mapped.views[generation] = mapped.views.get(generation, 0) + 1
            weakref.finalize(view, self._hand_back, mapped, generation)
            self._trim()
        return torch.frombuffer(view, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)

    def _hand_back(self, mapped: _Mapped, generation: int) -> None:
        """Marks the segment free for its sender once the last tensor built on this generation is gone, unless the
        sender has moved on since. Once only: the sender may claim the segment as soon as it reads it free, and a
        second hand-back of the same generation, reading before that claim and writing after it, would undo it."""
        with self._lock:
            left = mapped.views[generation] - 1
            if left:
                mapped.views[generation] = left
            else:
                del mapped.views[generation]
            if not left and not mapped.mapping.closed and _HEADER.unpack_from(mapped.mapping, 0)[1] == generation:
                _HEADER.pack_into(mapped.mapping, 0, _MAGIC, generation, _FREE)
            mapped.idle_since = time.monotonic()
            self._trim()

    def _trim(self) -> None:
        now = time.monotonic()
        idle = [(path, m) for path, m in self._mapped.items() if not m.views]
        kept = sum(len(m.mapping) for _, m in idle)
        for path, mapped in idle:  # oldest first
            if kept <= self._keep_bytes and now - mapped.idle_since < self._keep_seconds:
                continue
            size = len(mapped.mapping)
            try:
                mapped.mapping.close()
            except BufferError:  # at exit, finalizers run while their views still exist: leave it to the exit
                continue
            kept -= size
            del self._mapped[path]


def _map(path: str) -> mmap.mmap:
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as error:
        raise DataLoss(f"shared segment {path} cannot be opened: {error.strerror}") from None
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)


_RECEIVED = Mappings()


def write_probe() -> tuple[str, bytes]:
    """A fresh segment holding a random token, for a peer to read back (ProbeSharedMemory).

    OSError when /dev/shm has no room for it (nothing is left behind): then there is no same-host path.
    """
    path, token = _new_path(), secrets.token_bytes(16)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, token)
    except OSError:
        os.unlink(path)
        raise
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
