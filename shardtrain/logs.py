"""How a service logs: to stderr, as text or as JSON lines (one object a line, for log collectors), at a level."""

from __future__ import annotations

import datetime
import json
import logging

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT = "%(asctime)s %(name)s %(levelname)s %(message)s"


# Fields a log call may pass (logging's `extra=`) that JSON lines carry as their own keys, for log collectors to
# filter on rather than parse out of the message.
FIELDS = ("deployment", "stage", "step", "method", "code", "peer")


def fields(**values) -> dict:
    """`extra=` for a log call: the structured fields of a record (deployment, stage, step, method, code, peer)."""
    unknown = set(values) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown log fields {sorted(unknown)}; known: {FIELDS}")
    return values


class JsonLines(logging.Formatter):
    """{"time", "level", "logger", "message"} per record, the time in RFC 3339 with its zone (UTC), plus the
    structured fields the record carries and "exception" when one was logged."""

    def format(self, record: logging.LogRecord) -> str:
        time = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        line = {"time": time.isoformat(timespec="milliseconds").replace("+00:00", "Z"), "level": record.levelname,
                "logger": record.name, "message": record.getMessage()}
        line.update((name, getattr(record, name)) for name in FIELDS if hasattr(record, name))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(level: str = "info", form: str = "text") -> None:
    """Sends every shardtrain logger's records at `level` or above to stderr, as `form` ("text" or "json")."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines() if form == "json" else logging.Formatter(TEXT))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)
