"""The simulated clock and the event queue: a heap of (time, sequence, callback). Equal times run in the order
they were scheduled, so a run is a pure function of its inputs and seed."""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class SimClock:
    """Simulated seconds; callable, so it can be injected where the real code takes `clock=time.monotonic`."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a while. A simulation's objects form no reference cycles
    (tests/sim/test_fleet.py checks), so reference counting frees all of them; the collector would only re-scan the
    millions of live objects (token lists, block tables) again and again: about 40% of a fleet run's time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        # Everything allocated meanwhile is still in the youngest generation: collected on the first allocation
        # after enable(), a scan of every live object of the run. Moved to the oldest instead (two list splices).
        gc.freeze()
        gc.unfreeze()
        if enabled:
            gc.enable()


class EventQueue:
    def __init__(self, clock: SimClock) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._seq = 0
        self.processed = 0
        self.stop_hooks: list[Callable[[], None]] = []  # called when run() returns: lazy state brought up to now

    def at(self, when: float, callback: Callable, *args) -> None:
        """Runs callback(*args) at simulated time `when` (never in the past)."""
        self._seq += 1
        heapq.heappush(self._heap, (max(when, self.clock.now), self._seq, callback, args))

    def after(self, delay: float, callback: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self.clock.now + max(delay, 0.0), self._seq, callback, args))

    def run(self, until: float | None = None) -> None:
        heap, clock, pop = self._heap, self.clock, heapq.heappop
        with collector_paused():
            while heap and (until is None or heap[0][0] <= until):
                when, _, callback, args = pop(heap)
                clock.now = when
                callback(*args)
                self.processed += 1
        if until is not None and clock.now < until:
            clock.now = until
        for hook in self.stop_hooks:
            hook()
