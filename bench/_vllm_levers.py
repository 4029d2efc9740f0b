"""vLLM CPU worker for bench/kv_capacity.py and bench/speculative.py; runs inside the vLLM venv (../shared/design/
peers.md):

    /tmp/vllm/bin/python bench/_vllm_levers.py capacity|speculative SPEC.json RESULT.json

capacity: one engine with the KV budget in bytes (kv_cache_memory_bytes: what VLLM_CPU_KVCACHE_SPACE sets, in
bytes rather than whole GiB) and kv_cache_dtype; RESULT gets the tokens its cache holds, and the most requests
running at once (vllm:num_requests_running after every step) while `requests` prompts of prompt_len tokens are
served to the end, with the wall time. speculative: one engine with or without speculative_config; per batch size,
`runs` timed runs of the prompts in waves of the batch (as bench/speculative.py does with ours), each token's
arrival timed at the step that returned it; RESULT gets per run the median ITL, tokens/s and the spec-decode
counters. Stdlib and vllm only; everything under `if __name__ == "__main__":` because vllm.LLM spawns processes.
"""

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_worker(python: str, mode: str, spec: dict) -> tuple:
    """From the benchmarks (any Python): this file run by the vLLM venv's `python` on `spec`. (the result, None),
    or (None, the error vLLM gave: its last line naming an Error)."""
    with tempfile.TemporaryDirectory(prefix="vllm-levers-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        done = subprocess.run(
            [python, __file__, mode, str(spec_path), str(out_path)], capture_output=True, text=True, timeout=1800
        )
        if done.returncode == 0 and out_path.exists():
            return json.loads(out_path.read_text()), None
    errors = [ln for ln in done.stderr.splitlines() if "Error" in ln]
    return None, (errors[-1] if errors else done.stderr.strip() or f"exit code {done.returncode}")[-400:]


def make_llm(spec: dict, **options):
    from vllm import LLM

    return LLM(
        model=spec["model_dir"],
        dtype=spec["dtype"],
        enforce_eager=True,
        max_model_len=spec["max_model_len"],
        seed=0,
        disable_log_stats=False,
        **options,
    )


def metric_values(llm) -> dict:
    return {m.name: getattr(m, "value", None) for m in llm.get_metrics()}


def params(max_tokens: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0, detokenize=False, output_kind=RequestOutputKind.DELTA
    )


def capacity(spec: dict) -> dict:
    from vllm.inputs import TokensPrompt

    llm = make_llm(spec, kv_cache_memory_bytes=spec["budget_bytes"], kv_cache_dtype=spec["kv_cache_dtype"])
    cache = llm.llm_engine.vllm_config.cache_config
    engine = llm.llm_engine
    for i, prompt in enumerate(spec["prompts"]):
        engine.add_request(f"c{i}", TokensPrompt(prompt_token_ids=prompt), params(spec["max_tokens"]))
    most, tokens = 0, 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += sum(len(c.token_ids) for c in out.outputs)
        most = max(most, int(metric_values(llm).get("vllm:num_requests_running") or 0))
    wall = time.perf_counter() - started
    return {
        "kv_cache_tokens": cache.num_gpu_blocks * cache.block_size,
        "block_size": cache.block_size,
        "max_running": most,
        "wall_s": wall,
        "output_tokens": tokens,
    }


def speculative(spec: dict) -> dict:
    options = {"kv_cache_memory_bytes": spec["budget_bytes"]}
    if spec["speculative_config"] is not None:
        options["speculative_config"] = spec["speculative_config"]
    llm = make_llm(spec, **options)
    timed_wave(llm, spec["warmup"], 2, 16)
    rows = []
    for batch in spec["batches"]:
        runs = [timed_wave(llm, prompts, batch, spec["max_tokens"]) for prompts in spec["runs"]]
        rows.append({"batch": batch, "runs": runs})
    return {"rows": rows}


def spec_counts(llm) -> tuple[float, float, float]:
    m = metric_values(llm)
    names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
    return tuple(float(m.get(n) or 0) for n in names)


def timed_wave(llm, prompts: list, batch: int, max_tokens: int) -> dict:
    """The prompts in waves of `batch`, each wave added at once and stepped to its end; each token timed at the
    step that returned it."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    before = spec_counts(llm)
    arrivals: dict = {}
    steps = 0
    started = time.perf_counter()
    for wave in range(0, len(prompts), batch):
        for i, prompt in enumerate(prompts[wave : wave + batch]):
            engine.add_request(f"s{time.monotonic_ns()}-{i}", TokensPrompt(prompt_token_ids=prompt), params(max_tokens))
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            steps += 1
            for out in outputs:
                n = sum(len(c.token_ids) for c in out.outputs)
                if n:
                    arrivals.setdefault(out.request_id, []).append((now, n))
    elapsed = time.perf_counter() - started
    per_request, tokens = [], 0
    for times in arrivals.values():
        n = sum(count for _, count in times)
        tokens += n
        if n > times[0][1]:
            per_request.append((times[-1][0] - times[0][0]) / (n - times[0][1]) * 1000)
    drafts, proposed, accepted = (a - b for a, b in zip(spec_counts(llm), before))
    return {
        "itl_ms": statistics.median(per_request),
        "tokens_per_s": tokens / elapsed,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        "steps": steps,
    }


def main(mode: str, spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    torch.set_num_threads(spec["threads"])
    result = capacity(spec) if mode == "capacity" else speculative(spec)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
