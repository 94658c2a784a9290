"""Exception classes and their gRPC status codes: one table, read in both directions."""

from __future__ import annotations

import re

MAX_MESSAGE = 2000  # characters of a status message; gRPC carries it in a header, whose size is bounded
_TRACEBACK = re.compile(r"(Traceback \(most recent call last\)|Original traceback):.*", re.S)
_SOURCE_LINE = re.compile(r'\s*File "[^"]*", line \d+')
_SOURCE_PATH = re.compile(r"(?:/[^\s/:\"']+)+/([^\s/:\"']+\.py)")


class ShardtrainError(Exception):
    """Base of every error shardtrain raises on purpose; `code` names its gRPC status code."""

    code = "INTERNAL"


class InvalidArgument(ShardtrainError, ValueError):
    """The request itself is wrong: shape, dtype, name, size or an unknown option."""

    code = "INVALID_ARGUMENT"


class FailedPrecondition(ShardtrainError, RuntimeError):
    """The request is well formed but the receiver is not in a state to serve it."""

    code = "FAILED_PRECONDITION"


class NotFound(ShardtrainError, LookupError):
    """A named thing (step, tensor, deployment) does not exist on the receiver."""

    code = "NOT_FOUND"


class AlreadyExists(ShardtrainError):
    """The thing the request would create is already there."""

    code = "ALREADY_EXISTS"


class ResourceExhausted(ShardtrainError):
    """A bound on memory, in-flight steps or message size would be exceeded."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(ShardtrainError, ConnectionError):
    """A peer cannot be reached (not started, dead, or unreachable)."""

    code = "UNAVAILABLE"


class DeadlineExceeded(ShardtrainError, TimeoutError):
    """A call or a wait on a peer ran past its deadline."""

    code = "DEADLINE_EXCEEDED"


class DataLoss(ShardtrainError):
    """Bytes arrived damaged or incomplete."""

    code = "DATA_LOSS"


class Unauthenticated(ShardtrainError, PermissionError):
    """The caller did not present the expected token."""

    code = "UNAUTHENTICATED"


class PermissionDenied(ShardtrainError, PermissionError):
    """The caller's token does not give the role the call needs (a client token where a shard's is needed...)."""

    code = "PERMISSION_DENIED"


class Aborted(ShardtrainError):
    """The work was given up and must be done again from an earlier point; the message says which."""

    code = "ABORTED"


class RolledBack(Aborted):
    """A dead shard was replaced and the model went back to its last snapshot: `resume_step` train_step calls
    stand (model.steps_done); train again on the batches after them."""

    def __init__(self, message: str, resume_step: int = 0):
        super().__init__(message)
        self.resume_step = resume_step


class Cancelled(ShardtrainError):
    """The caller gave up on the call."""

    code = "CANCELLED"


class InternalError(ShardtrainError):
    """A bug or an unexpected failure inside a service; the message says where."""

    code = "INTERNAL"


ERRORS: tuple[type[ShardtrainError], ...] = (
    InvalidArgument, FailedPrecondition, NotFound, AlreadyExists, ResourceExhausted,
    Unavailable, DeadlineExceeded, DataLoss, Unauthenticated, PermissionDenied, Aborted, Cancelled, InternalError,
)
_BY_CODE: dict[str, type[ShardtrainError]] = {cls.code: cls for cls in ERRORS}


def error_for_code(code: str, message: str) -> ShardtrainError:
    """The exception for a gRPC status code name; codes with no class of their own become InternalError."""
    return _BY_CODE.get(code, InternalError)(message)


def located_message(error: Exception, where: str) -> str:
    """An exception's message fit to leave the server, naming `where` unless it already names a place (a peer's
    error names the peer; do not wrap it in our own name again, nor our own twice)."""
    if isinstance(error, ShardtrainError):
        named = getattr(error, "from_peer", False) or str(error).startswith(where)
        return public_message(str(error) if named else f"{where}: {error}")
    return public_message(f"{where}: unexpected {type(error).__name__}: {error}")


def public_message(text: str) -> str:
    """`text` fit to leave the server: no traceback, no source path of the server, at most MAX_MESSAGE long."""
    text = _TRACEBACK.sub("(traceback withheld)", text)
    text = "\n".join(line for line in text.splitlines() if not _SOURCE_LINE.match(line))
    text = _SOURCE_PATH.sub(r"\1", text)
    if len(text) > MAX_MESSAGE:
        text = f"{text[:MAX_MESSAGE - 40]} ... ({len(text)} characters in all)"
    return text
