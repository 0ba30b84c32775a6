"""Logs an operator can read: one format for the router and the pools' actors (text, or one JSON
object a line for a log collector), the id of the request being served on every line logged
while it is (a context variable the router and the verifier set), and the router's one line per
finished request (`request_line`).

Outrider's own loggers (`router.*`, `cluster.*`, `workers.*`, `kernels.*` and
`outrider.requests`) log at INFO; everything else keeps the root logger's WARNING.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar
from typing import Any, TextIO

FORMATS = ("text", "json")
REQUEST_LOGGER = "outrider.requests"
OWN_LOGGERS = ("router", "cluster", "workers", "kernels", "outrider")

# The request whose work is running: set by the router for a request's generation and by the
# verifier actor for its stream (each in its own task, so concurrent requests do not mix).
REQUEST_ID: ContextVar[str | None] = ContextVar("outrider_request_id", default=None)


class _RequestId(logging.Filter):
    """Puts the current request's id on each record (`record.request_id`, None outside one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        return True


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return dict(fields) if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, request_id when
    there is one, and the record's `fields` (a request line's numbers)."""

    def format(self, record: logging.LogRecord) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        row: dict[str, Any] = {
            "time": f"{when}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if rid := getattr(record, "request_id", None):
            row["request_id"] = rid
        row.update(_fields(record))
        if record.exc_info:
            row["exception"] = self.formatException(record.exc_info)
        return json.dumps(row, default=str)


class TextFormatter(logging.Formatter):
    """`time level logger [request id] message key=value ...`"""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(request)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        record.request = f" [{rid}]" if rid else ""
        line = super().format(record)
        fields = _fields(record)
        if fields:
            line += " " + " ".join(f"{k}={_text(v)}" for k, v in fields.items())
        return line


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return json.dumps(text) if " " in text or not text else text


class _Handler(logging.StreamHandler[TextIO]):
    """Ours, so that configuring again replaces it rather than adding a second one."""


def configure(fmt: str = "text", stream: TextIO | None = None) -> None:
    """Log Outrider's lines (INFO and up) and everyone's warnings in `fmt` to `stream`
    (default stderr). Idempotent: a second call replaces the first's handler."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    handler = _Handler(stream or sys.stderr)
    handler.addFilter(_RequestId())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    if root.level > logging.WARNING or root.level == logging.NOTSET:
        root.setLevel(logging.WARNING)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)


def request_line(fields: dict[str, Any]) -> None:
    """The router's line for a finished request (its id, outcome and numbers in `fields`)."""
    rid = fields.get("request_id")
    logging.getLogger(REQUEST_LOGGER).info(
        "request %s%s",
        f"{rid} " if rid else "",
        fields.get("outcome"),
        extra={"fields": fields, "request_id": rid},
    )
