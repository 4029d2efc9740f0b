"""vLLM CPU worker for bench/offline_throughput.py; runs inside the vLLM venv (see bench/setup_peers.sh):

    VLLM_CPU_KVCACHE_SPACE=4 /tmp/vllm/bin/python bench/_vllm_worker.py SPEC.json RESULT.json

SPEC.json is written by offline_throughput.py (model_dir, workload_path, threads, warmup_requests, warmup_tokens,
max_model_len); RESULT.json gets wall_s (the timed generate() call only), load_s and the output token ids.
Everything runs under `if __name__ == "__main__":` because vllm.LLM spawns processes.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cpuprobe import timed_run  # noqa: E402  (stdlib only)


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    with open(spec["workload_path"]) as f:
        reqs = json.load(f)["requests"]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(spec.get("kv_cache_gib", 4))))

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(spec["threads"])
    t = time.perf_counter()
    llm = LLM(model=spec["model_dir"], dtype="float32", enforce_eager=True, max_model_len=spec["max_model_len"], seed=0)
    load_s = time.perf_counter() - t

    def run(rs):
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in rs]
        sps = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0, detokenize=False) for r in rs]
        outs = llm.generate(prompts, sps, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    warm = [
        {"prompt_token_ids": r["prompt_token_ids"], "max_tokens": spec["warmup_tokens"]}
        for r in reqs[: spec["warmup_requests"]]
    ]
    run(warm)
    outputs, wall, others = timed_run(run, reqs)

    sched = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    sched = getattr(sched, "scheduler_config", None)
    extra = ""
    if sched is not None:
        extra = (
            f"; max_num_seqs {getattr(sched, 'max_num_seqs', '?')}, "
            f"max_num_batched_tokens {getattr(sched, 'max_num_batched_tokens', '?')}"
        )
    result = {
        "wall_s": wall,
        "load_s": load_s,
        "outputs": outputs,
        "version": vllm.__version__,
        "others_cpu": others,
        "torch": torch.__version__,
        "notes": (
            f"LLM(dtype=float32, enforce_eager=True, max_model_len={spec['max_model_len']}), "
            f"VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE')} GiB, "
            f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}, "
            f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '') or '-'}, "
            f"SamplingParams(ignore_eos=True, temperature=0, detokenize=False), TokensPrompt inputs{extra}"
        ),
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
