"""How much CPU did OTHER processes use while a benchmark's timed window ran?  (stdlib only: also imported by
_vllm_worker.py inside the vLLM venv.)

    probe = CpuProbe(); probe.start(); ...timed work...; others = probe.stop(wall_s)
    result, wall_s, others = timed_run(work, *args)   # the same around one call

`others` = (CPU time of the whole machine, from /proc/stat) - (CPU time of this process and its descendants, from
/proc/PID/stat), as a fraction of wall_s x cores.  ~0 on a quiet machine; 0.5 on 2 cores = one core's worth of
someone else's work competed with the benchmark.  Linux only; returns None elsewhere.

Servers the benchmark drives but did not start (a database's backend processes, redis-server) count as its own when
their pids are given: probe.start(pids); ...; probe.stop(wall_s, pids); their CPU seconds are then in
probe.pids_cpu_s.  A pid given only to stop() counts from 0 (it started meanwhile); the CPU of one that exited during
the window is lost (counted as others').
"""

import os
import time

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_ticks() -> int:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v[:8]) - idle  # user nice system idle iowait irq softirq steal (guest is already in user)


def _tree_ticks(root: int) -> int:
    stats = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                data = f.read()
        except OSError:
            continue
        rest = data[data.rfind(")") + 2 :].split()
        # fields after "(comm)": state ppid ... utime(12th) stime(13th) cutime cstime
        stats[int(name)] = (int(rest[1]), int(rest[11]) + int(rest[12]) + int(rest[13]) + int(rest[14]))
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
        todo.extend(children.get(pid, []))
    return total


class CpuProbe:
    def __init__(self) -> None:
        self._start = None
        self._extra = {}
        self.pids_cpu_s = None

    def start(self, pids=()) -> None:
        try:
            self._start = (_machine_busy_ticks(), _tree_ticks(os.getpid()))
            self._extra = {pid: _tree_ticks(pid) for pid in pids}
        except (OSError, ValueError, IndexError):
            self._start = None

    def stop(self, wall_s: float, pids=()):
        if self._start is None or wall_s <= 0:
            return None
        try:
            busy = _machine_busy_ticks() - self._start[0]
            own = _tree_ticks(os.getpid()) - self._start[1]
            extra = sum(max(0, _tree_ticks(pid) - self._extra.get(pid, 0)) for pid in set(pids) | set(self._extra))
        except (OSError, ValueError, IndexError):
            return None
        self.pids_cpu_s = extra / _HZ  # CPU seconds the given pids used in the window
        own += extra
        return max(0.0, (busy - own) / _HZ / (wall_s * (os.cpu_count() or 1)))


def timed_run(work, *args):
    """(work(*args), its wall seconds, the share of the CPUs other processes used meanwhile)."""
    probe = CpuProbe()
    probe.start()
    t = time.perf_counter()
    result = work(*args)
    wall = time.perf_counter() - t
    return result, wall, probe.stop(wall)
