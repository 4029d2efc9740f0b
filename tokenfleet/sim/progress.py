"""A progress line for a long simulation, from a wall-clock thread that only reads the fleet's clock and counters:
the simulation's own event order is untouched, so reports stay the same with or without it."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from tokenfleet.sim.fleet import Fleet


class Progress:
    """`with Progress(fleet):` prints simulated time, requests and an ETA every `interval_s` of wall time: one
    line rewritten in place on a terminal, plain lines elsewhere (a CI log)."""

    def __init__(self, fleet: Fleet, out: TextIO = sys.stderr, interval_s: float | None = None) -> None:
        self.fleet, self.out = fleet, out
        self.tty = out.isatty()
        self.interval_s = interval_s if interval_s is not None else (0.5 if self.tty else 10.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._report_until_stopped, name="sim-progress", daemon=True)
        self._started = 0.0

    def __enter__(self) -> Progress:
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.tty:
            self.out.write("\r\033[K")
            self.out.flush()

    def line(self) -> str:
        simulated, end = self.fleet.clock.now, self.fleet.end_s
        elapsed = time.perf_counter() - self._started
        share = min(simulated / end, 1.0) if end > 0 else 1.0
        eta = f"{elapsed * (1 - share) / share:.0f} s" if share > 0 else "?"
        return (
            f"simulated {simulated:,.0f} of {end:,.0f} s ({share:.0%}), {self.fleet.requests_seen:,} requests, "
            f"{elapsed:.0f} s so far, about {eta} left"
        )

    def _report_until_stopped(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.out.write(("\r\033[K" if self.tty else "") + self.line() + ("" if self.tty else "\n"))
            self.out.flush()
