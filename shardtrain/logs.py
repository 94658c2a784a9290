"""How a service logs: to stderr, as text or as JSON lines (one object a line, for log collectors), at a level."""

from __future__ import annotations

import json
import logging

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class JsonLines(logging.Formatter):
    """{"time", "level", "logger", "message"} per record, plus "exception" when one was logged."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure(level: str = "info", form: str = "text") -> None:
    """Sends every shardtrain logger's records at `level` or above to stderr, as `form` ("text" or "json")."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines() if form == "json" else logging.Formatter(TEXT))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)
