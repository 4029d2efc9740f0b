"""The simulator drives the engine only through its verbs (Scheduler.add/schedule/update/finish/park/unpark,
KVBlockManager.allocate/mark_computed/take_blocks/free_request, Request.append_token(s)): no code in
tokenfleet/sim/ writes a field of the engine's Request, Scheduler or KVBlockManager, and none hangs an attribute
on a Request (the simulator's own record of a request is its SimRequest).

Two checks. A scan of the source finds writes by the field's name: assignments, deletions, item writes and
mutating calls. Some names are shared with the simulator's own records (SimRequest.status, the router's
ReplicaState.running and .waiting), so a write through `self` or a variable holding such a record (RECORDS) is
let through by the scan; the second check, a run with the engine's classes watching every attribute write, catches
what a name cannot tell apart."""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest
import yaml

import tokenfleet.sim
from tests.sim.helpers import make_requests, run_replica
from tokenfleet.engine.kv_blocks import KVBlockManager
from tokenfleet.engine.request import Request, SamplingParams
from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig
from tokenfleet.sim import config
from tokenfleet.sim.disagg import DisaggFleet, DisaggSpec
from tokenfleet.sim.models import model_shape

SIM = Path(tokenfleet.sim.__file__).resolve().parent
# variables that hold the simulator's own records, whose fields the simulator owns
RECORDS = {"self", "sreq", "stage", "state"}
MUTATORS = {
    "append",
    "extend",
    "insert",
    "remove",
    "pop",
    "clear",
    "sort",
    "reverse",
    "update",
    "setdefault",
    "popitem",
    "add",
    "discard",
    "__setitem__",
    "__delitem__",
    "__iadd__",
}
MUTATING_FUNCTIONS = {
    "insort",
    "insort_left",
    "insort_right",
    "heappush",
    "heappop",
    "heapify",
    "heapreplace",
    "heappushpop",
}


def engine_fields() -> set[str]:
    blocks = KVBlockManager(4, 16)
    scheduler = Scheduler(SchedulerConfig(), blocks)
    return {f.name for f in dataclasses.fields(Request)} | set(vars(scheduler)) | set(vars(blocks))


FIELDS = engine_fields()


def _called_name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _written(target: ast.expr) -> list[ast.expr]:
    """The objects an assignment or deletion target changes: `x.f` for `x.f = ...` and `x.f[i] = ...`."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for element in target.elts for t in _written(element)]
    if isinstance(target, ast.Starred):
        return _written(target.value)
    while isinstance(target, ast.Subscript):
        target = target.value
    return [target]


def _changed(node: ast.AST) -> list[ast.expr]:
    """What a statement or call changes: assignment and deletion targets, the object a mutating method or function
    (list.append, bisect.insort, ...) is applied to."""
    if isinstance(node, (ast.Assign, ast.Delete)):
        return [t for target in node.targets for t in _written(target)]
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return _written(node.target)
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            return _written(node.func.value)
        if _called_name(node.func) in MUTATING_FUNCTIONS and node.args:
            return _written(node.args[0])
    return []


def _engine_field(node: ast.expr) -> str | None:
    """The engine field `node` names, when it is `<anything but one of the simulator's records>.<field>`."""
    if isinstance(node, ast.Attribute) and node.attr in FIELDS:
        if not (isinstance(node.value, ast.Name) and node.value.id in RECORDS):
            return node.attr
    return None


def _sets_field_by_name(node: ast.AST) -> bool:
    """setattr(x, "field", ...) or delattr(x, "field")."""
    return (
        isinstance(node, ast.Call)
        and _called_name(node.func) in {"setattr", "delattr"}
        and len(node.args) > 1
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value in FIELDS
    )


def _uses_sim_attribute(node: ast.AST) -> bool:
    """An attribute named `sim` (what the simulator once hung on the engine's Request), read or written; the
    package path `tokenfleet.sim` is not one."""
    if not (isinstance(node, ast.Attribute) and node.attr == "sim"):
        return False
    root = node.value
    while isinstance(root, ast.Attribute):
        root = root.value
    return not (isinstance(root, ast.Name) and root.id == "tokenfleet")


def writes_to_engine(source: str, filename: str = "<source>") -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        found += [f"{where}: changes .{name}" for name in map(_engine_field, _changed(node)) if name]
        if _sets_field_by_name(node):
            found.append(f"{where}: {_called_name(node.func)} of an engine field")
        if _uses_sim_attribute(node):
            found.append(f"{where}: .sim")
    return found


def test_no_simulator_module_writes_an_engine_field() -> None:
    found = []
    for path in sorted(SIM.glob("*.py")):
        found += writes_to_engine(path.read_text(), str(path.relative_to(SIM.parents[1])))
    assert found == []


@pytest.mark.parametrize(
    "line",
    [
        "req.sim = sreq",
        "sreq = req.sim",
        "sched.running = keep",
        "self.scheduler.running.append(req)",
        "del req.token_ids[pos + 2:]",
        "req.token_ids.extend(sreq.output)",
        "req.num_computed_tokens = pos + 1",
        "p.req.num_computed_tokens += 1",
        "holder.block_hashes = sreq.hashes",
        "sched.config = replace(base)",
        "req.status, req.finish_reason = 'finished', 'abort'",
        "bisect.insort(sched.queue, req)",
        "setattr(req, 'block_table', [])",
        "self.scheduler.num_parked -= 1",
    ],
)
def test_the_scan_finds_writes_to_the_engine(line) -> None:
    assert writes_to_engine(line)


@pytest.mark.parametrize(
    "line",
    [
        "sreq.status = 'ok'",
        "state.running = len(sched.running)",
        "self.parked[req] = p",
        "req.append_token(t)",
        "self.scheduler.unpark(req, n)",
        "from tokenfleet.sim.request import SimRequest",
        "n = len(req.token_ids)",
    ],
)
def test_the_scan_lets_the_simulator_use_its_records_and_the_engine_verbs(line) -> None:
    assert writes_to_engine(line) == []


# --- the same at run time ---------------------------------------------------------------------------------------

WATCHED = (Request, Scheduler, KVBlockManager)


@pytest.fixture
def sim_writes(monkeypatch) -> set[str]:
    """Where code in tokenfleet/sim/ wrote or deleted an attribute of the engine's objects."""
    writes: set[str] = set()
    prefix = str(SIM) + "/"

    def watching(change):
        def watched(obj, name, *value):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(prefix):
                writes.add(f"{type(obj).__name__}.{name} from {frame.f_code.co_filename}:{frame.f_lineno}")
            change(obj, name, *value)

        return watched

    for cls in WATCHED:
        monkeypatch.setattr(cls, "__setattr__", watching(object.__setattr__), raising=False)
        monkeypatch.setattr(cls, "__delattr__", watching(object.__delattr__), raising=False)
    return writes


def test_the_watch_sees_a_write_from_the_simulator(sim_writes) -> None:
    req = Request("r", [1, 2, 3], SamplingParams())
    exec(compile("req.status = None", str(SIM / "probe.py"), "exec"), {"req": req})
    assert sim_writes == {f"Request.status from {SIM / 'probe.py'}:1"}


def test_a_replica_with_parking_preemption_and_cancellations_writes_no_engine_field(sim_writes) -> None:
    requests = make_requests(3, 60, 20.0)
    replica, sink = run_replica(requests, num_blocks=300, host_blocks=60)
    assert len(sink.done) == 60 and replica.scheduler.num_preemptions > 0
    assert "abort" in {reason for _, _, reason, *_ in sink.done.values()}
    assert sim_writes == set()


def test_a_disaggregated_fleet_writes_no_engine_field(sim_writes) -> None:
    raw = yaml.safe_load("""
        seed: 5
        duration_s: 10
        drain_s: 60
        fleet: {replicas: 3, gpu: h100, tensor_parallel: 1, model: llama-8b, weight_dtype: fp16}
        workload: {rate: 6, cancel_probability: 0, output_tokens_mean: 60, tiers: {paid: 0.5, free: 0.5}}
        gateway: {quota: false}
    """)
    fleet = DisaggFleet(config.parse(raw), DisaggSpec(1, 2, model_shape("llama-8b").kv_bytes_per_token("fp16")))
    fleet.run()
    assert fleet.transfers > 10 and not fleet.flights
    assert sim_writes == set()
