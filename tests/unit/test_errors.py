"""shardtrain.errors: one table of exception classes and gRPC status codes, read in both directions."""

from __future__ import annotations

import grpc
import pytest

from shardtrain import errors
from shardtrain.errors import ERRORS, InternalError, error_for_code

EXPECTED_CODES = {
    errors.InvalidArgument: "INVALID_ARGUMENT",
    errors.FailedPrecondition: "FAILED_PRECONDITION",
    errors.NotFound: "NOT_FOUND",
    errors.AlreadyExists: "ALREADY_EXISTS",
    errors.ResourceExhausted: "RESOURCE_EXHAUSTED",
    errors.Unavailable: "UNAVAILABLE",
    errors.DeadlineExceeded: "DEADLINE_EXCEEDED",
    errors.DataLoss: "DATA_LOSS",
    errors.Unauthenticated: "UNAUTHENTICATED",
    errors.PermissionDenied: "PERMISSION_DENIED",
    errors.Aborted: "ABORTED",
    errors.Cancelled: "CANCELLED",
    errors.InternalError: "INTERNAL",
}


def test_table_lists_every_class_with_its_code():
    assert {cls: cls.code for cls in ERRORS} == EXPECTED_CODES


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_code_is_a_grpc_status_code_name(cls):
    assert grpc.StatusCode[cls.code].name == cls.code


def test_codes_are_unique():
    codes = [cls.code for cls in ERRORS]
    assert len(codes) == len(set(codes))


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_error_for_code_gives_back_exactly_the_class_with_the_message(cls):
    error = error_for_code(cls.code, "stage 2: something specific")
    assert type(error) is cls
    assert str(error) == "stage 2: something specific"


@pytest.mark.parametrize("code", ["UNKNOWN", "OUT_OF_RANGE", "UNIMPLEMENTED",
                                  "OK", "NOT_A_CODE", ""])
def test_codes_without_a_class_become_internal_error(code):
    error = error_for_code(code, "peer said so")
    assert type(error) is InternalError
    assert str(error) == "peer said so"


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_every_error_is_a_shardtrain_error(cls):
    assert issubclass(cls, errors.ShardtrainError)


@pytest.mark.parametrize(("cls", "builtin"), [
    (errors.InvalidArgument, ValueError),
    (errors.FailedPrecondition, RuntimeError),
    (errors.NotFound, LookupError),
    (errors.Unavailable, ConnectionError),
    (errors.DeadlineExceeded, TimeoutError),
    (errors.Unauthenticated, PermissionError),
])
def test_errors_are_also_the_matching_builtin_exception(cls, builtin):
    assert issubclass(cls, builtin)


def test_a_public_message_withholds_tracebacks_and_source_paths():
    text = ("stage 1: layer 3 raised RuntimeError: bad\nWhile executing %x\nOriginal traceback:\n"
            '  File "/srv/venv/lib/torch/nn/module.py", line 1775, in _call_impl\n    return forward_call(*args)')
    assert errors.public_message(text) == "stage 1: layer 3 raised RuntimeError: bad\nWhile executing %x\n" \
                                          "(traceback withheld)"
    assert errors.public_message("Traceback (most recent call last):\n  File \"x.py\"") == "(traceback withheld)"
    assert errors.public_message("failed in /home/me/shard_service/stage.py:12") == "failed in stage.py:12"
    assert errors.public_message("segment /dev/shm/shardtrain-1-00ff is gone") == \
        "segment /dev/shm/shardtrain-1-00ff is gone"  # a path that is not source stays: it names what was wrong


def test_a_public_message_is_bounded_and_says_how_long_it_was():
    bounded = errors.public_message("x" * 100_000)
    assert len(bounded) <= errors.MAX_MESSAGE and bounded.endswith("(100000 characters in all)")
