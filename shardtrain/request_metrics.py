"""Every request a server answers, counted and timed for metrics.py: a gRPC server interceptor that wraps each
call's handler (unary or streaming, ours or the health and reflection services') and records its method, status
code and seconds once it ends."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable

import grpc

from shardtrain import metrics

# The attribute of grpc.RpcMethodHandler holding the behavior, by (request streaming, response streaming).
_BEHAVIORS = {(False, False): "unary_unary", (False, True): "unary_stream",
              (True, False): "stream_unary", (True, True): "stream_stream"}


class RequestMetrics(grpc.aio.ServerInterceptor):
    """Counts each call by method and code and times it, from its arrival to its handler's end (a stream's end).
    First among a server's interceptors, it also counts the calls a later one refuses (auth.py's)."""

    async def intercept_service(self, continuation, details):
        start = time.perf_counter()
        handler = await continuation(details)
        if handler is None:  # no such method: grpc answers UNIMPLEMENTED; a caller's made-up names are no label
            metrics.request("unknown", "UNIMPLEMENTED", time.perf_counter() - start)
            return None
        name = _BEHAVIORS[handler.request_streaming, handler.response_streaming]
        behavior = getattr(handler, name)
        method = details.method.rpartition("/")[2]
        if inspect.isasyncgenfunction(behavior):
            return handler._replace(**{name: _timed_stream(behavior, method, start)})
        if inspect.iscoroutinefunction(behavior):
            return handler._replace(**{name: _timed(behavior, method, start)})
        return handler  # a synchronous handler (none here): grpc runs it on a thread, uncounted


def _timed(behavior: Callable, method: str, start: float) -> Callable:
    async def timed(request, context):
        error = None
        try:
            return await behavior(request, context)
        except BaseException as raised:
            error = raised
            raise
        finally:
            metrics.request(method, _code(context, error), time.perf_counter() - start)
    return timed


def _timed_stream(behavior: Callable, method: str, start: float) -> Callable:
    async def timed(request, context):
        error = None
        try:
            async for response in behavior(request, context):
                yield response
        except BaseException as raised:
            error = raised
            raise
        finally:
            metrics.request(method, _code(context, error), time.perf_counter() - start)
    return timed


def _code(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    """The status the call ended with: the one set or aborted with, else OK when the handler returned, the
    deadline or a cancellation when it was cancelled, UNKNOWN (grpc's answer) when it raised."""
    code = context.code()
    if code is not None:
        return code.name
    if error is None:
        return "OK"
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining()
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
    return "UNKNOWN"
