"""The servers' log format, in a module of its own so that any process (an engine worker included) can set it up
without loading the HTTP stack."""

from __future__ import annotations

import logging


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per load poll and health check otherwise
