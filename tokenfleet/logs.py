"""The servers' log format, in a module of its own so that any process (an engine worker included) can set it up
without loading the HTTP stack; and the request a line is about, so that one request can be followed from the
gateway to the replica (its id travels in the `x-request-id` header) and into the engine (whose request ids start
with it)."""

from __future__ import annotations

import logging
import re
from contextvars import ContextVar
from typing import TextIO

# the request whose work the current task is doing; set by the gateway and the replica as a request starts
REQUEST_ID: ContextVar[str | None] = ContextVar("tokenfleet_request_id", default=None)
_REQUEST_ID_FORM = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def valid_request_id(value: str | None) -> str | None:
    """A request id from outside (a header) if it is safe to use as one: ASCII letters, digits and . _ : -, at most
    128 characters (it goes into logs, headers and engine request ids); None otherwise."""
    return value if value is not None and _REQUEST_ID_FORM.fullmatch(value) else None


class _WithRequestId(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        request_id = REQUEST_ID.get()
        record.request = f"[{request_id}] " if request_id else ""
        return True


def log_handler(stream: TextIO | None = None, process: str | None = None) -> logging.Handler:
    """Lines to stderr (or `stream`), each naming the request it is about when there is one, and `process` (one
    of several workers) when given."""
    handler = logging.StreamHandler(stream)
    handler.addFilter(_WithRequestId())
    where = f"[{process}] " if process else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {where}%(name)s: %(request)s%(message)s"))
    return handler


def configure_logging(process: str | None = None) -> None:
    logging.basicConfig(level=logging.INFO, handlers=[log_handler(process=process)])
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per load poll and health check otherwise
