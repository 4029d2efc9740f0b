"""The demo checkpoint that `tokenfleet serve` and `tokenfleet fleet` use when no --model is given."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)
DEMO_DIR = Path.home() / ".cache" / "tokenfleet" / "demo-model"


def demo_checkpoint() -> Path:
    """The demo checkpoint's folder, written first when missing (a tokenizer trained here and random weights)."""
    if not (DEMO_DIR / "config.json").is_file():
        from tokenfleet.model.demo import write_demo_checkpoint

        log.info("no --model given: writing the demo checkpoint to %s (once)", DEMO_DIR)
        started = time.monotonic()
        # written aside and renamed into place, so a process starting meanwhile never reads half a checkpoint
        partial = DEMO_DIR.with_name(f".{DEMO_DIR.name}-{os.getpid()}")
        write_demo_checkpoint(partial, size="small")
        try:
            partial.rename(DEMO_DIR)
        except OSError:
            if (DEMO_DIR / "config.json").is_file():  # another process put its copy there first: the same bytes
                shutil.rmtree(partial, ignore_errors=True)
            else:  # the leftovers of an interrupted write
                shutil.rmtree(DEMO_DIR)
                partial.rename(DEMO_DIR)
        log.info("demo checkpoint written in %.1f s", time.monotonic() - started)
    return DEMO_DIR
