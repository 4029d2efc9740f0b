#!/usr/bin/env python3
"""What tensor parallelism costs on CPU: engine step time at tensor_parallel_size 1 and 2 (a batch of decodes, and
one prefill), the time the ranks spend inside all-reduce at TP 2, the same all-reduces between two bare processes,
and the simulator's TP communication term (sim/cost_model.py) with this machine's link calibrated from them:
predicted vs measured.

Run by hand, never from the test suite (about a minute on 2 quiet cores):

    nice -n 10 python bench/tensor_parallel.py --out docs/benchmarks/tensor_parallel.md

The checkpoint: a random Llama made by the tests' helper (tests/checkpoints.make_checkpoint) with --hidden,
--intermediate, --layers, --heads and --kv-heads (float32). Engines run in this process (rank 0; TP 2 starts its
worker rank as a replica does) with the cores split the way a replica splits them: TP 1 with --threads PyTorch
threads, TP 2 with --threads / 2 per rank; a TP 1 row with --threads / 2 threads shows what one rank's share of
the cores does with the whole model. Each engine decodes --batch sequences (prompts of --context tokens, after
--warmup steps) for --decode-steps timed steps, then runs --prefills timed steps of one --prompt-tokens prompt
each (after one untimed). The engines take turns in --rounds rounds, so that a slow stretch of a shared machine
falls on all of them. Every collective of the sharded layers is timed in both ranks (the opt-in
TOKENFLEET_TP_COLLECTIVE_LOG timing of tokenfleet/model/parallel.py) and charged to the step it falls in. Both
ranks make the same all-reduces in the same order; of each pair, the shorter time is the exchange itself (the
rank that came last waited for nothing else), the longer one also holds the first rank's wait for the other.

The bare all-reduces: rank 0 (this process) and one spawned process, one PyTorch thread each, the engine's own
gloo group (ProcessGroupCollectives); each round of the engines is followed by --raw-iters / --rounds timed calls
per message size: the engine's sizes and a sweep. The sweep calibrates the cost model's link (fleet.hardware
allreduce_latency_s and link_bytes_per_s with link_efficiency 1: least squares of the median time per call over
the bytes a ring all-reduce moves), and sim/cost_model.roofline gives the TP term of each step
(allreduce_per_step_s + allreduce_per_token_s x tokens), compared with the exchange times of the layers'
all-reduces measured in the engine (the cost model counts 2 per layer; the engine also all-reduces the
embedding). The report goes to --out; every step's timings to tensor_parallel.json in --run-dir.
"""

from __future__ import annotations

import argparse
import bisect
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import cpu_model, git_head, make_run_dir, report_header  # noqa: E402

COLLECTIVE_LOG_ENV = "TOKENFLEET_TP_COLLECTIVE_LOG"  # tokenfleet/model/parallel.py reads it at import
SWEEP_TOKENS = (1, 4, 16, 64, 256, 1024)  # message sizes of the bare all-reduce sweep, in tokens of hidden size


@dataclass
class StepTiming:
    seconds: float
    tokens: int
    collectives: dict[str, float] = field(default_factory=dict)  # "rank0 all_reduce" etc. -> seconds in the step
    all_reduces: int = 0  # rank 0's all-reduce calls in the step
    message_bytes: list[int] = field(default_factory=list)  # their payloads


@dataclass
class Phase:
    tp: int
    threads: int  # PyTorch threads per rank
    name: str  # decode | prefill
    steps: list[StepTiming]

    def median(self, what: str) -> float:
        return statistics.median(s.seconds if what == "step" else s.collectives.get(what, 0.0) for s in self.steps)

    def share(self, what: str) -> float:
        """Median over the steps of the part of the step spent in `what`."""
        return statistics.median(s.collectives.get(what, 0.0) / s.seconds for s in self.steps)


@dataclass
class RawSize:
    message_bytes: int
    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


# --- the engines ------------------------------------------------------------------------------------------------


def make_model(run_dir: Path, args: argparse.Namespace) -> Path:
    from tests.checkpoints import make_checkpoint

    return make_checkpoint(
        run_dir / "ckpt",
        "llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        initializer_range=0.02,
    )


@dataclass
class Subject:
    """One engine under test, and its timed steps."""

    tp: int
    threads: int  # PyTorch threads per rank
    engine: Any  # tokenfleet.engine.engine.Engine
    decode: list[StepTiming] = field(default_factory=list)
    prefill: list[StepTiming] = field(default_factory=list)

    def phases(self) -> list[Phase]:
        return [
            Phase(self.tp, self.threads, "decode", self.decode),
            Phase(self.tp, self.threads, "prefill", self.prefill),
        ]


def build_engine(path: Path, tp: int, threads: int, args: argparse.Namespace):
    import torch

    from tokenfleet.engine.config import EngineConfig
    from tokenfleet.engine.engine import Engine

    torch.set_num_threads(threads)
    config = EngineConfig(
        str(path),
        tensor_parallel_size=tp,
        threads=threads,
        skip_tokenizer_init=True,
        kv_cache_gib=0.1,
        swap_space_gib=0.01,
        max_num_batched_tokens=max(2048, args.prompt_tokens),
        max_model_len=max(args.context + args.warmup + args.decode_steps, args.prompt_tokens) + 8,
    )
    return Engine(config)


def measure(path: Path, configs: list[tuple[int, int]], bare: BareAllReduces, args: argparse.Namespace) -> list[Phase]:
    """Every engine's decode steps, then its prefill steps, interleaved in --rounds rounds with the bare
    all-reduces' rounds (so that a slow stretch of a shared machine falls on all of them); the collectives of both
    ranks charged to the steps they fall in."""
    import torch

    from tokenfleet.model import parallel

    subjects = [Subject(tp, threads, build_engine(path, tp, threads, args)) for tp, threads in configs]
    timed: list[tuple[float, float, StepTiming]] = []
    try:
        for subject in subjects:
            torch.set_num_threads(subject.threads)
            start_decodes(subject.engine, args)
        for _ in range(args.rounds):
            for subject in subjects:
                torch.set_num_threads(subject.threads)
                subject.decode += [timed_step(subject.engine, args.batch, timed)[0] for _ in range(per_round(args))]
            bare.round()
        for subject in subjects:
            stop_decodes(subject.engine, args)
            prefill(subject.engine, args, "warm-up", [])
        for round_ in range(args.rounds):
            for subject in subjects:
                torch.set_num_threads(subject.threads)
                for i in range(max(1, args.prefills // args.rounds)):
                    subject.prefill.append(prefill(subject.engine, args, f"{round_}-{i}", timed))
    finally:
        for subject in subjects:
            if subject.engine.tensor_parallel is not None:
                subject.engine.tensor_parallel.close()  # the worker writes its timings as it exits
    records = {"rank0": list(parallel.COLLECTIVE_TIMINGS.records), "rank1": []}
    for subject in subjects:
        if subject.engine.tensor_parallel is not None:
            pid = subject.engine.tensor_parallel.worker_pids[0]
            records["rank1"] += worker_records(Path(os.environ[COLLECTIVE_LOG_ENV]), pid)
    records["last in"] = last_arrivals(records["rank0"], records["rank1"])
    charge_collectives(timed, records)
    return [phase for subject in subjects for phase in subject.phases()]


def per_round(args: argparse.Namespace) -> int:
    return max(1, args.decode_steps // args.rounds)


def start_decodes(engine, args: argparse.Namespace) -> None:
    """--batch requests of --context-token prompts, prefilled, and --warmup decode steps."""
    from tokenfleet.engine.request import SamplingParams

    steps = args.warmup + per_round(args) * args.rounds + 2
    params = SamplingParams(max_tokens=steps, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(random_prompts(args.batch, args.context, args.vocab, seed=1)):
        engine.add_request(prompt, params, request_id=f"decode-{i}")
    while sum(len(r.output_token_ids) > 0 for r in engine.scheduler.running) < args.batch:
        engine.step()
    for _ in range(args.warmup):
        engine.step()


def stop_decodes(engine, args: argparse.Namespace) -> None:
    for i in range(args.batch):
        engine.abort(f"decode-{i}")
    engine.step()


def prefill(engine, args: argparse.Namespace, name: str, timed: list) -> StepTiming:
    """One step prefilling one --prompt-tokens prompt (a new one each time: no prefix-cache hit)."""
    from tokenfleet.engine.request import SamplingParams

    [prompt] = random_prompts(1, args.prompt_tokens, args.vocab, seed=zlib.crc32(name.encode()))
    engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False), request_id=name)
    step, [out] = timed_step(engine, args.prompt_tokens, timed)
    assert out.finished and out.num_cached_tokens == 0, "a prefill took more than one step, or hit the prefix cache"
    return step


def timed_step(engine, tokens: int, timed: list) -> tuple[StepTiming, list]:
    """The step's timing (also kept in `timed` with its window) and its outputs."""
    start = time.monotonic()
    outputs = engine.step()
    end = time.monotonic()
    step = StepTiming(end - start, tokens)
    timed.append((start, end, step))
    return step, outputs


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def worker_records(folder: Path, pid: int, wait_s: float = 10.0) -> list:
    path = next(folder.glob(f"rank*-{pid}.json"), None)
    deadline = time.monotonic() + wait_s
    while path is None and time.monotonic() < deadline:
        time.sleep(0.1)
        path = next(folder.glob(f"rank*-{pid}.json"), None)
    if path is None:
        raise RuntimeError(f"worker rank (pid {pid}) wrote no collective timings to {folder}")
    return json.loads(path.read_text())["records"]


def last_arrivals(rank0: list, rank1: list) -> list:
    """Each all-reduce as the rank that came to it last saw it: both ranks call the same all-reduces in the same
    order, and the one that arrives last waits only for the exchange itself, while the other also waits for it.
    So the shorter of the two times is the all-reduce's own cost (what the cost model prices), the longer one minus
    it the first rank's wait for the second (load imbalance, or a rank descheduled on a shared machine)."""
    ours = [r for r in rank0 if r[0] == "all_reduce"]
    theirs = [r for r in rank1 if r[0] == "all_reduce"]
    if len(ours) != len(theirs):
        raise RuntimeError(f"rank 0 timed {len(ours)} all-reduces, rank 1 {len(theirs)}: they cannot be paired")
    return [("all_reduce", a[1], min(a[2], b[2]), a[3]) for a, b in zip(ours, theirs)]


def charge_collectives(timed: list[tuple[float, float, StepTiming]], records: dict[str, list]) -> None:
    """Adds each record (who -> their collectives) to the timed step whose window (on the shared monotonic clock)
    it starts in; those of untimed steps (warm-up, prefills of the decode batch) are dropped."""
    timed = sorted(timed, key=lambda t: t[0])
    starts = [t[0] for t in timed]
    for who, who_records in records.items():
        for kind, start, seconds, size in sorted(who_records, key=lambda r: r[1]):
            i = bisect.bisect_right(starts, start) - 1
            if i < 0 or start > timed[i][1]:
                continue
            step = timed[i][2]
            if kind == "all_reduce" and who in ("rank0", "last in"):
                first = f"{who} first all_reduce"
                if first not in step.collectives:  # the embedding's: rank 0's also waits for rank 1 to get the step
                    step.collectives[first] = seconds
                if who == "rank0":
                    step.all_reduces += 1
                    step.message_bytes.append(size)
            key = f"{who} {kind}"
            step.collectives[key] = step.collectives.get(key, 0.0) + seconds


# --- the bare all-reduces ---------------------------------------------------------------------------------------


class BareAllReduces:
    """Rank 0 here, rank 1 a spawned process, one PyTorch thread each, the engine's gloo group. round() times
    `iters` back-to-back all-reduces of each size (bytes), both ranks in step; rounds are taken between the
    engines' rounds, so that the bare and the in-engine all-reduces see the same machine. with_compute() times
    all-reduces with a stretch of matrix products before each on both ranks, as the engine's layers have."""

    def __init__(self, sizes: list[int], iters: int) -> None:
        from torch._C._distributed_c10d import TCPStore

        self.sizes, self.iters = sizes, iters
        self.seconds: dict[int, list[float]] = {size: [] for size in sizes}
        store = TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.peer = context.Process(target=_bare_peer, args=(store.port, theirs))
        self.peer.start()
        self.collectives = _collectives(store, 0)

    def round(self) -> None:
        for size in self.sizes:
            self.seconds[size] += self._both(size, 0.0, self.iters)

    def with_compute(self, size: int, compute_s: float, iters: int) -> list[float]:
        """Each call's exchange: the shorter of the two ranks' times in it (the rank that came last waited for
        nothing else)."""
        ours = self._both(size, compute_s, iters)
        return [min(a, b) for a, b in zip(ours, self.conn.recv())]

    def _both(self, size: int, compute_s: float, iters: int) -> list[float]:
        import torch

        torch.set_num_threads(1)
        self.conn.send((size, compute_s, iters))
        return _timed_all_reduces(self.collectives, size, compute_s, iters)

    def results(self) -> list[RawSize]:
        return [RawSize(size, self.seconds[size]) for size in self.sizes]

    def close(self) -> None:
        self.conn.send(None)
        self.peer.join(30)
        if self.peer.is_alive():
            self.peer.kill()


def _collectives(store, rank: int):
    import torch

    from tokenfleet.engine.tensor_parallel import ProcessGroupCollectives

    return ProcessGroupCollectives(store, rank, 2, torch.device("cpu"))


def _timed_all_reduces(collectives, size: int, compute_s: float, iters: int) -> list[float]:
    import torch

    tensor = torch.ones(size // 4, dtype=torch.float32)
    a, b = torch.rand(256, 256), torch.rand(256, 256)
    for _ in range(10):
        collectives.all_reduce(tensor)
    seconds = []
    for _ in range(iters):
        deadline = time.perf_counter() + compute_s
        while time.perf_counter() < deadline:
            torch.mm(a, b)
        start = time.perf_counter()
        collectives.all_reduce(tensor)
        seconds.append(time.perf_counter() - start)
    return seconds


def _bare_peer(port: int, conn) -> None:
    os.environ.pop(COLLECTIVE_LOG_ENV, None)  # not an engine rank: no timing file
    import torch
    from torch._C._distributed_c10d import TCPStore

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
    collectives = _collectives(store, 1)
    while (job := conn.recv()) is not None:
        size, compute_s, iters = job
        seconds = _timed_all_reduces(collectives, size, compute_s, iters)
        if compute_s:
            conn.send(seconds)


# --- the cost model ---------------------------------------------------------------------------------------------


@dataclass
class LinkFit:
    latency_s: float  # per all-reduce
    bytes_per_s: float  # of the bytes a ring all-reduce moves (2 (N-1) / N x the payload)


def fit_link(raw: list[RawSize], tp: int = 2) -> LinkFit:
    """Least squares of the median time per call against the bytes a ring moves: the cost model's form."""
    import numpy as np

    ring = 2 * (tp - 1) / tp
    x = np.array([[1.0, r.message_bytes * ring] for r in raw])
    y = np.array([r.median for r in raw])
    (latency, per_byte), *_ = np.linalg.lstsq(x, y, rcond=None)
    return LinkFit(max(float(latency), 0.0), 1.0 / max(float(per_byte), 1e-15))


def predicted_tp_term(path: Path, link: LinkFit, tokens: int) -> float:
    """sim/cost_model.roofline's all-reduce term of a step of `tokens` tokens at TP 2 with the fitted link."""
    from tokenfleet.model.config import ModelConfig
    from tokenfleet.sim.cost_model import roofline
    from tokenfleet.sim.hardware import hardware
    from tokenfleet.sim.models import ModelShape

    config = ModelConfig.from_dir(path)
    shape = ModelShape(
        "bench", 1.0, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    )
    hw = hardware("h100").with_overrides(
        allreduce_latency_s=link.latency_s, link_bytes_per_s=link.bytes_per_s, link_efficiency=1.0
    )
    c = roofline(shape, hw, "fp16", "fp32", 2)
    return c.allreduce_per_step_s + c.allreduce_per_token_s * tokens


# --- the report -------------------------------------------------------------------------------------------------


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "(uptime unavailable)"


def ms(seconds: float) -> str:
    return f"{1000 * seconds:.2f}"


def step_table(phases: list[Phase]) -> list[str]:
    lines = [
        "| step | TP | threads per rank | step (ms) | vs TP 1, all threads | vs TP 1, one rank's threads | "
        "all-reduces / step | rank 0 in all-reduce (ms) | share of step | of which the exchange itself (ms) | "
        "rank 1 in all-reduce (ms) | rank 0 in logits gather (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    most, fewest = max(p.threads for p in phases), min(p.threads for p in phases)
    whole = {(p.name, p.threads): p.median("step") for p in phases if p.tp == 1}
    for p in phases:
        step = p.median("step")
        cells = [p.name, str(p.tp), str(p.threads), ms(step)]
        cells += [f"{step / whole[p.name, threads]:.2f}x" for threads in (most, fewest)]
        if p.tp > 1:
            cells += [
                f"{statistics.median(s.all_reduces for s in p.steps):g}",
                ms(p.median("rank0 all_reduce")),
                f"{p.share('rank0 all_reduce'):.0%}",
                ms(p.median("last in all_reduce")),
                ms(p.median("rank1 all_reduce")),
                ms(p.median("rank0 gather")),
            ]
        else:
            cells += ["-"] * 6
        lines.append("| " + " | ".join(cells) + " |")
    return lines


@dataclass
class Comparison:
    """One TP 2 step kind: the cost model's TP term against the bare and the in-engine all-reduces. The cost model
    counts the layers' all-reduces (2 per layer); the engine also all-reduces the embedding, first in the step."""

    name: str
    tokens: int
    message_bytes: int
    layer_all_reduces: int
    bare_per_call_s: float
    compute_between_s: float  # the engine's compute per all-reduce, put between the bare calls of the next column
    bare_with_compute_s: float  # a bare call's exchange with that compute before each call, median
    predicted_s: float  # sim/cost_model.roofline as it is (2-byte activations)
    predicted_fp32_s: float  # the same formula with the engine's float32 payload
    measured_layers_s: float  # the layers' all-reduces per step as the last rank in saw them, median
    measured_embedding_s: float  # ... the embedding's, median

    @property
    def bare_per_step_s(self) -> float:
        return self.bare_per_call_s * self.layer_all_reduces


def bare_with_compute(bare: BareAllReduces, phase: Phase, args: argparse.Namespace) -> tuple[float, list[float]]:
    """The bare all-reduce of the phase's message size with the phase's compute between calls: its median step
    time outside all-reduce over its all-reduces per step. Returns that compute time and each call's exchange."""
    calls = statistics.median(s.all_reduces for s in phase.steps)
    compute_s = max(0.0, phase.median("step") - phase.median("rank0 all_reduce")) / calls
    size = statistics.mode(b for s in phase.steps for b in s.message_bytes)
    iters = int(min(args.raw_iters, max(30, 4.0 / max(compute_s, 1e-3))))
    return compute_s, bare.with_compute(size, compute_s, iters)


def comparisons(
    path: Path,
    phases: list[Phase],
    raw: list[RawSize],
    link: LinkFit,
    hidden: int,
    with_compute: dict[str, tuple[float, list[float]]],
) -> list[Comparison]:
    bare = {r.message_bytes: r.median for r in raw}
    rows = []
    for p in phases:
        if p.tp == 1:
            continue
        tokens, layers = p.steps[0].tokens, int(statistics.median(s.all_reduces for s in p.steps)) - 1
        size = statistics.mode(b for s in p.steps for b in s.message_bytes)
        first = [s.collectives.get("last in first all_reduce", 0.0) for s in p.steps]
        rest = [s.collectives.get("last in all_reduce", 0.0) - f for s, f in zip(p.steps, first)]
        fp32 = layers * (link.latency_s + tokens * hidden * 4 / link.bytes_per_s)  # a ring moves 1x at TP 2
        rows.append(
            Comparison(
                p.name,
                tokens,
                size,
                layers,
                bare.get(size, float("nan")),
                with_compute[p.name][0],
                statistics.median(with_compute[p.name][1]),
                predicted_tp_term(path, link, tokens),
                fp32,
                statistics.median(rest),
                statistics.median(first),
            )
        )
    return rows


def comparison_table(rows: list[Comparison]) -> list[str]:
    """One column per TP 2 step kind; times per step unless said."""
    quantities = [
        ("tokens in the step", lambda r: str(r.tokens)),
        ("bytes per all-reduce", lambda r: str(r.message_bytes)),
        ("all-reduces: the layers' (+ the embedding's)", lambda r: f"{r.layer_all_reduces} (+1)"),
        ("bare all-reduce, back to back (us per call)", lambda r: f"{1e6 * r.bare_per_call_s:.0f}"),
        (
            "bare all-reduce after the engine's compute per call (us per call; the compute)",
            lambda r: f"{1e6 * r.bare_with_compute_s:.0f} (after {ms(r.compute_between_s)} ms)",
        ),
        ("**cost model TP term** (ms)", lambda r: f"**{ms(r.predicted_s)}**"),
        ("cost model's formula with the engine's float32 payload (ms)", lambda r: ms(r.predicted_fp32_s)),
        ("**measured: the layers' all-reduces, exchange only** (ms)", lambda r: f"**{ms(r.measured_layers_s)}**"),
        ("measured: the embedding's all-reduce, exchange only (ms)", lambda r: ms(r.measured_embedding_s)),
        ("**measured / cost model**", lambda r: f"**{r.measured_layers_s / r.predicted_s:.2f}**"),
        ("measured / formula with float32", lambda r: f"{r.measured_layers_s / r.predicted_fp32_s:.2f}"),
        (
            "measured / (bare after compute x layers' all-reduces)",
            lambda r: f"{r.measured_layers_s / (r.bare_with_compute_s * r.layer_all_reduces):.2f}",
        ),
    ]
    lines = ["| TP 2 | " + " | ".join(r.name for r in rows) + " |", "|---|" + "---:|" * len(rows)]
    lines += [f"| {name} | " + " | ".join(cell(r) for r in rows) + " |" for name, cell in quantities]
    return lines


def raw_table(raw: list[RawSize], link: LinkFit) -> list[str]:
    lines = ["| bytes | median (us) | p10-p90 (us) | fitted (us) |", "|---:|---:|---:|---:|"]
    for r in raw:
        deciles = statistics.quantiles(r.seconds, n=10)
        fitted = link.latency_s + r.message_bytes / link.bytes_per_s
        lines.append(
            f"| {r.message_bytes} | {1e6 * r.median:.0f} | {1e6 * deciles[0]:.0f}-{1e6 * deciles[-1]:.0f} | "
            f"{1e6 * fitted:.0f} |"
        )
    return lines


def render(args: argparse.Namespace, phases: list[Phase], raw, link: LinkFit, rows, load: dict) -> str:
    machine = f"{cpu_model()}, {os.cpu_count()} cores; commit {git_head()}."
    model = (
        f"random Llama (tests/checkpoints.make_checkpoint), hidden {args.hidden}, MLP {args.intermediate}, "
        f"{args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads, vocabulary {args.vocab}, float32"
    )
    return "\n".join(
        [
            *report_header(__file__, machine, load),
            f"Model: {model}. Decode: {args.batch} sequences of {args.context}-token prompts, {args.decode_steps} "
            f"timed steps; prefill: {args.prefills} steps of one {args.prompt_tokens}-token prompt. Medians over "
            "the steps.",
            "",
            *step_table(phases),
            "",
            "Bare gloo all-reduce between two processes (one thread each), "
            f"{max(1, args.raw_iters // args.rounds) * args.rounds} calls per size:",
            "",
            *raw_table(raw, link),
            "",
            f"Link fitted on the sweep (the cost model's form, latency + ring bytes / bandwidth): allreduce_latency_s "
            f"= {link.latency_s * 1e6:.0f} us, link_bytes_per_s = {link.bytes_per_s / 1e9:.2f} GB/s "
            "(link_efficiency 1).",
            "",
            *comparison_table(rows),
            "",
        ]
    )


# --- main -------------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="markdown report (and its .json beside it)")
    p.add_argument("--run-dir", help="the checkpoint and the ranks' timing files (default: a new temp dir)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2, help="PyTorch threads at TP 1 (TP 2: half per rank)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--decode-steps", type=int, default=80)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--prefills", type=int, default=12)
    p.add_argument("--rounds", type=int, default=4, help="the engines take turns, this many times")
    p.add_argument("--raw-iters", type=int, default=300)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    run_dir = make_run_dir(args.run_dir, "tokenfleet-tp-")
    (run_dir / "collectives").mkdir(exist_ok=True)
    os.environ[COLLECTIVE_LOG_ENV] = str(run_dir / "collectives")  # before tokenfleet.model.parallel is imported
    load = {"before": uptime()}
    path = make_model(run_dir, args)
    half = max(1, args.threads // 2)
    configs = [(1, args.threads), (2, half)] + ([(1, half)] if half != args.threads else [])
    bytes_per_token = args.hidden * 4
    sweep = {t * bytes_per_token for t in SWEEP_TOKENS}
    engine_sizes = {args.batch * bytes_per_token, args.prompt_tokens * bytes_per_token}
    bare = BareAllReduces(sorted(sweep | engine_sizes), max(1, args.raw_iters // args.rounds))
    try:
        phases = measure(path, configs, bare, args)
        print("engines: done", flush=True)
        with_compute = {p.name: bare_with_compute(bare, p, args) for p in phases if p.tp > 1}
    finally:
        bare.close()
    raw = bare.results()
    link = fit_link([r for r in raw if r.message_bytes in sweep])
    rows = comparisons(path, phases, raw, link, args.hidden, with_compute)
    load["after"] = uptime()
    report = render(args, phases, raw, link, rows, load)
    print(report)
    data = {
        "args": vars(args),
        "load": load,
        "phases": [{**asdict(p), "steps": [asdict(s) for s in p.steps]} for p in phases],
        "raw": [asdict(r) for r in raw],
        "link": asdict(link),
        "comparisons": [asdict(r) for r in rows],
        "bare_with_compute": {name: {"compute_s": c, "seconds": x} for name, (c, x) in with_compute.items()},
    }
    (run_dir / "tensor_parallel.json").write_text(json.dumps(data) + "\n")
    if args.out:
        Path(args.out).write_text(report)
    print(f"timings: {run_dir / 'tensor_parallel.json'}")


if __name__ == "__main__":
    main()
