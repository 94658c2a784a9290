"""Where a checkpoint's files go and how they reach the disk.

Each save writes its parts under a directory of its own, `generation-<generation>/` inside the checkpoint
directory, and is published by one atomic rename of `checkpoint.json`, which names the generation; then the
other generations go. A generation's directory that checkpoint.json does not name is a save that did not
finish (a shard died, a disk filled), and the checkpoint is refused until a save succeeds or it is removed.
Files are their owner's alone (0600, directories 0700), or also a configured group's (0640, 0750), whatever
the umask; OS errors become statuses that name the path and the bytes free there.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pathlib
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass

from shardtrain.errors import InvalidArgument, PermissionDenied, ResourceExhausted, ShardtrainError, Unavailable

log = logging.getLogger("shardtrain.checkpoint")

PREFIX = "generation-"
_GENERATION = re.compile(r"[0-9]{8}T[0-9]{6}-[0-9a-f]{8}")
_PART = re.compile(r"(model|optimizer)-(\d{5})-of-(\d{5})\.safetensors")
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_REFUSED = frozenset({errno.EACCES, errno.EPERM})


@dataclass(frozen=True)
class Access:
    """Who may read what is written: its owner only, or also `group` (a gid; -1: none)."""

    group: int = -1

    @property
    def file_mode(self) -> int:
        return 0o640 if self.group >= 0 else 0o600

    @property
    def directory_mode(self) -> int:
        return 0o750 if self.group >= 0 else 0o700

    def apply(self, target: int | str | os.PathLike, mode: int) -> None:
        """Gives `target` (a path, or an open descriptor) this access's group and `mode`, umask or not."""
        chown, chmod = (os.fchown, os.fchmod) if isinstance(target, int) else (os.chown, os.chmod)
        if self.group >= 0:
            chown(target, -1, self.group)
        chmod(target, mode)


PRIVATE = Access()


def new_generation() -> str:
    """A fresh generation name: when (UTC, to the second) and 32 random bits."""
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"


def check_generation(generation: str) -> str:
    """`generation`, if it is one new_generation could have made (it becomes part of a path)."""
    if not _GENERATION.fullmatch(generation):
        raise InvalidArgument(f"checkpoint generation {generation[:80]!r} must look like 20250101T120000-0123abcd "
                              "(one per save, chosen by the client)")
    return generation


def generation_directory(root: pathlib.Path, generation: str) -> pathlib.Path:
    return root / (PREFIX + check_generation(generation))


def others(root: pathlib.Path, published: str) -> list[pathlib.Path]:
    """The generation directories of `root` other than the published one's, oldest first."""
    try:
        names = sorted(entry.name for entry in os.scandir(root) if entry.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []
    return [root / name for name in names if name.startswith(PREFIX) and name != PREFIX + published]


def unfinished(directory: pathlib.Path) -> str:
    """What a generation's directory that was never published holds, for an error message: which stages finished
    their parts, and which were cut off while writing (a temporary file is left)."""
    finished: dict[int, set[str]] = {}
    cut, parts = set(), 0
    with contextlib.suppress(OSError):  # removed meanwhile: it holds nothing
        for name in os.listdir(directory):
            match = _PART.fullmatch(name.removesuffix(".partial"))
            if match:
                part, parts = int(match[2]), max(parts, int(match[3]))
                if name.endswith(".partial"):
                    cut.add(part)
                else:
                    finished.setdefault(part, set()).add(match[1])
    done = sorted(part for part, kinds in finished.items() if len(kinds) == 2 and part not in cut)

    def who(found) -> str:
        return "its one part" if parts == 1 else f"stage{'s' if len(found) > 1 else ''} {', '.join(map(str, found))}"
    said = [f"{who(sorted(cut))} cut off while being written"] if cut else []
    said += [f"{who(done)} finished"] if done else []
    return "; ".join(said) or "what it wrote was removed when it failed"


def make_directory(path: pathlib.Path, access: Access) -> None:
    """Makes `path` and any missing parents, each with the access's directory mode; existing ones stay as they
    are."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another shard made it meanwhile
            os.mkdir(directory, access.directory_mode)
            access.apply(directory, access.directory_mode)


@contextlib.contextmanager
def new_file(path: pathlib.Path, access: Access) -> Iterator:
    """A file opened for binary writing at `path` (not through a symbolic link), with the access's mode and group
    from the start, synced to disk when the block ends."""
    handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, access.file_mode)
    with os.fdopen(handle, "wb") as out:
        access.apply(handle, access.file_mode)
        yield out
        out.flush()
        os.fsync(handle)


def sync_directory(path: pathlib.Path) -> None:
    """Makes the renames in `path` durable."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def remove(*paths: pathlib.Path) -> None:
    """Removes each file that exists; a failure is logged, not raised (this runs on the way out of another)."""
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            log.warning("could not remove %s: %s", path, error.strerror)


def sweep(root: pathlib.Path, published: str, legacy: tuple[str, ...]) -> None:
    """Removes what a published checkpoint no longer needs: the other generations, and the files of the layouts
    before generations (`legacy` names, and parts at the top of `root`). Failures are logged: the checkpoint is
    published already."""
    try:
        for directory in others(root, published):
            shutil.rmtree(directory, ignore_errors=True)
            if directory.exists():
                log.warning("could not remove %s, a save this checkpoint replaced: loads refuse the checkpoint "
                            "until it is gone", directory)
        remove(*(root / name for name in os.listdir(root)
                 if name in legacy or _PART.fullmatch(name.removesuffix(".partial"))))
    except OSError as error:
        log.warning("could not clear %s of what its checkpoint replaced: %s", root, error.strerror)


def free_bytes(path: pathlib.Path) -> int | None:
    """The bytes an unprivileged writer may still use on `path`'s filesystem (its nearest existing ancestor's)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def storage_error(error: OSError, path: pathlib.Path) -> ShardtrainError:
    """The status for an OS error while writing `path`: no room is RESOURCE_EXHAUSTED, a refusal
    PERMISSION_DENIED, any other failure UNAVAILABLE; each names the path and the bytes free there."""
    free = free_bytes(path)
    message = f"checkpoint: writing {path} failed: {error.strerror or error} ({free if free is not None else '?'} " \
              "bytes free there); what this save had written is removed"
    if error.errno in _NO_ROOM:
        return ResourceExhausted(message)
    if error.errno in _REFUSED:
        return PermissionDenied(message)
    return Unavailable(message)
