#!/usr/bin/env python3
"""Offline throughput benchmark: tokenfleet vs. its peers, side by side, in one run.

Run by hand, never from the test suite:

    python bench/offline_throughput.py --size small --num-requests 200
    python bench/offline_throughput.py --size medium --systems hf_static,hf_cb,vllm,ceiling --num-requests 20 --out ''
    python bench/offline_throughput.py --model /path/to/hf_checkpoint ...

Every system serves the SAME checkpoint and the SAME seeded workload, each in its own fresh subprocess (fair memory
and threads: OMP/MKL threads and torch.set_num_threads = --threads, default = the number of cores).  Only the
generation call is timed: model load, KV-cache allocation and a warm-up (the workload's first --warmup-requests
prompts with --warmup-tokens output tokens each) happen before the clock starts.

Systems (--systems, comma separated, in this order):
  tokenfleet  tokenfleet.LLM(model=DIR, **--tokenfleet-options).generate(prompts, [SamplingParams(...)]), one call
              with the whole workload; each prompt is {"prompt_token_ids": [...]}.
  hf_static   transformers static batching: model.generate() on left-padded batches of --hf-batch-size requests in
              arrival order (no sorting).  Each batch runs for the largest max_tokens of its requests; only each
              request's own max_tokens output tokens count as useful (the rest is reported as waste).  Ignore-EOS
              is done with eos_token_id=None (EOS neither stops a row nor is masked), not min_new_tokens, which
              would mask EOS out of the argmax and so change the greedy outputs vs. the other systems.
  hf_cb       transformers continuous batching.  generate_batch() accepts ONE max_new_tokens for all requests, so to
              run the identical workload we use the manager it is built on (continuous_batching_context_manager +
              add_request, exactly what generate_batch() does internally) with each request's own max_new_tokens and
              eos_token_id=-1 (ignore EOS).  SDPA attention (no flash-attn on CPU), its default max_batch_tokens
              (8192).  KV cache: enough 256-token pages for the whole workload at once (as vLLM's 4 GiB is here),
              capped at --kv-cache-gib; a flat 4 GiB fails, because its attention-mask reservation grows with
              the cache (MemoryError, ~40 GB footprint).
  vllm        vLLM CPU (own venv, --vllm-python), bench/_vllm_worker.py: vllm.LLM(dtype=float32, enforce_eager=True),
              VLLM_CPU_KVCACHE_SPACE=--kv-cache-gib, SamplingParams(max_tokens, ignore_eos=True, temperature=0,
              detokenize=False), TokensPrompt inputs, one generate() call with the whole workload.  Threads: vLLM's
              own binding (VLLM_CPU_OMP_THREADS_BIND=auto, OMP_NUM_THREADS unset): on 2 cores the model runs on one
              core and the other is left to its front end and engine loop; forcing both cores (--vllm-omp-bind all)
              measured ~4x slower on this 2-core machine.
  ceiling     Bare model-forward ceiling (transformers LlamaForCausalLM forward + argmax, no scheduler/sampler/padding):
              * prefill rate: forward (batch 1, no padding, logits of the last position only, KV written into a cache)
                over a sample of the workload's prompts -> prompt tokens/s;
              * decode step time t(B): one forward of B new tokens (one per sequence) against a StaticCache holding
                C = mean prompt length + mean output length / 2 positions (the mean context a decode step attends to),
                + argmax, for B on a grid up to the number of requests; KV contents are zeros (timing does not
                depend on them); median of --ceiling-steps steps after 2 warm-up steps;
              * the ideal schedule: every request is admitted at t=0, so decode step k runs with
                B_k = #requests whose max_tokens > k; estimated wall = prompt_tokens / prefill rate
                + sum_k t(B_k) (t interpolated linearly between grid points).
              It is an estimate (no run of the workload); its per-B decode tokens/s = B / t(B) are reported too.

Workload: --num-requests requests, seeded (--seed); prompt lengths uniform in [--prompt-min, --prompt-max], token ids
uniform over the tokenizer's vocabulary minus its special tokens; output lengths uniform in [--output-min,
--output-max]; ignore_eos, greedy.  Greedy outputs of every system are compared with transformers (hf_static, or
hf_cb when hf_static is not run); note that random-weight models have nearly flat logits, so tiny numeric
differences (kernels, batch composition, padding) can flip an argmax and make otherwise-correct outputs diverge.

Checkpoints: --model DIR, or --size small|medium: made with `tokenfleet demo-model DIR --size SIZE` when that command
works, else built here (transformers LlamaConfig/LlamaForCausalLM random weights + a byte-level BPE tokenizer
trained on pydoc_data.topics), cached under --ckpt-root.

Contention: this machine is shared, and on 2 cores a single competing process can slow a 2-thread run by 10x or
more (OpenMP threads spin-waiting on a taken core).  Before each system the harness waits (up to --wait-idle s) for
the CPUs to go idle, and every timed window records "other CPU load" (bench/_cpuprobe.py: machine CPU time minus the
benchmark process tree's, as a share of all cores); rows above 10% are flagged as unreliable: rerun them.

Output: a markdown table (--out, default docs/benchmarks/offline_throughput.md) and a JSON next to it; per-system logs
are kept in the run directory (printed at the end).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import (  # noqa: E402  (stdlib only)
    CONTENDED,
    REPO,
    add_checkpoint_args,
    add_length_args,
    bench_parser,
    command_line,
    cpu_model,
    given_checkpoint,
    known_names,
    make_run_dir,
    memory_total,
    repo_env,
    wait_idle,
)
from _cpuprobe import CpuProbe, timed_run  # noqa: E402  (stdlib only)

ALL_SYSTEMS = ["tokenfleet", "hf_static", "hf_cb", "vllm", "ceiling"]
LABELS = {
    "tokenfleet": "tokenfleet (LLM.generate)",
    "hf_static": "transformers static batching",
    "hf_cb": "transformers continuous batching",
    "vllm": "vLLM CPU",
    "ceiling": "model-forward ceiling (estimate)",
}

# Fallback checkpoint shapes (used only when `tokenfleet demo-model` is not available).
BUILTIN_SIZES = {
    # ~5.0M parameters
    "small": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    # ~27.8M parameters
    "medium": dict(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
}
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


# ----------------------------------------------------------------------------------------------------------------- #
# checkpoints
# ----------------------------------------------------------------------------------------------------------------- #


def _ckpt_complete(d: Path) -> bool:
    return (d / "config.json").exists() and (d / "tokenizer.json").exists() and (d / "tokenizer_config.json").exists()


def build_checkpoint(out_dir: Path, size: str, seed: int = 0) -> None:
    """Random-weight HF Llama checkpoint + byte-level BPE tokenizer (run in a subprocess: imports torch)."""
    import pydoc_data.topics

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    shape = BUILTIN_SIZES[size]
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = list(pydoc_data.topics.topics.values())
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=shape["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out_dir)

    torch.manual_seed(seed)
    config = LlamaConfig(
        **shape,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.pad_token_id = hf_tok.pad_token_id
    model.save_pretrained(out_dir)
    n = sum(p.numel() for p in model.parameters())
    print(f"built {size} checkpoint in {out_dir}: {n / 1e6:.2f}M parameters, tokenizer vocab {tok.get_vocab_size()}")


def ensure_checkpoint(args) -> tuple[Path, str]:
    if args.model:
        return given_checkpoint(args.model)
    root = Path(args.ckpt_root)
    if not args.builtin_checkpoint:
        d = root / f"demo-{args.size}"
        # regenerated every run (a few seconds) so it never goes stale while demo-model evolves
        shutil.rmtree(d, ignore_errors=True)
        if shutil.which("tokenfleet"):
            cmd = ["tokenfleet", "demo-model", str(d), "--size", args.size]
        else:
            cmd = [
                sys.executable,
                "-c",
                "import sys; from tokenfleet.cli import main; sys.exit(main())",
                "demo-model",
                str(d),
                "--size",
                args.size,
            ]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
            ok = r.returncode == 0 and _ckpt_complete(d)
        except Exception as e:  # noqa: BLE001
            ok, r = False, None
            print(f"[ckpt] tokenfleet demo-model failed to run: {e}")
        if ok:
            return d, f"`tokenfleet demo-model --size {args.size}`"
        msg = (r.stderr or r.stdout).strip().splitlines()[-1:] if r is not None else []
        print(f"[ckpt] `tokenfleet demo-model` not usable ({' '.join(msg) or 'failed'}); using the built-in one")
    d = root / f"builtin-{args.size}"
    if not _ckpt_complete(d):
        r = subprocess.run(
            [sys.executable, __file__, "--build-checkpoint", str(d), "--size", args.size], text=True, timeout=600
        )
        if r.returncode != 0 or not _ckpt_complete(d):
            sys.exit("could not build the checkpoint")
    return d, f"built by bench/offline_throughput.py (LlamaForCausalLM random init, --size {args.size})"


def checkpoint_info(d: Path) -> dict:
    cfg = json.loads((d / "config.json").read_text())
    keys = [
        "architectures",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "tie_word_embeddings",
        "torch_dtype",
        "dtype",
    ]
    info = {k: cfg[k] for k in keys if k in cfg}
    h, v, L, i = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    nh = cfg["num_attention_heads"]
    kvh = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim") or h // nh
    per_layer = h * nh * hd + 2 * h * kvh * hd + nh * hd * h + 3 * h * i + 2 * h
    emb = v * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    info["parameters"] = per_layer * L + emb + h
    return info


# ----------------------------------------------------------------------------------------------------------------- #
# workload
# ----------------------------------------------------------------------------------------------------------------- #


def token_id_pool(d: Path, cfg_vocab: int) -> tuple[int, list[int]]:
    """(upper bound, sorted special ids): prompt ids are drawn from [0, upper) minus the special ids."""
    from tokenizers import Tokenizer  # light (no torch)

    special: set[int] = set()
    upper = cfg_vocab
    tj = d / "tokenizer.json"
    if tj.exists():
        tok = Tokenizer.from_file(str(tj))
        upper = min(cfg_vocab, tok.get_vocab_size(with_added_tokens=True))
        for tid, added in tok.get_added_tokens_decoder().items():
            if added.special:
                special.add(tid)
    tc = d / "tokenizer_config.json"
    if tc.exists():
        for tid, added in json.loads(tc.read_text()).get("added_tokens_decoder", {}).items():
            if added.get("special"):
                special.add(int(tid))
    cfg = json.loads((d / "config.json").read_text())
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = cfg.get(k)
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, int):
                special.add(x)
    return upper, sorted(special)


def make_workload(args, d: Path) -> dict:
    cfg = json.loads((d / "config.json").read_text())
    upper, special = token_id_pool(d, cfg["vocab_size"])
    allowed = [t for t in range(upper) if t not in set(special)]
    rng = random.Random(args.seed)
    reqs = []
    for _ in range(args.num_requests):
        plen = rng.randint(args.prompt_min, args.prompt_max)
        reqs.append(
            {
                "prompt_token_ids": [rng.choice(allowed) for _ in range(plen)],
                "max_tokens": rng.randint(args.output_min, args.output_max),
            }
        )
    return {
        "seed": args.seed,
        "requests": reqs,
        "id_upper": upper,
        "special_ids": special,
        "max_model_len": args.prompt_max + args.output_max,
    }


# ----------------------------------------------------------------------------------------------------------------- #
# workers (each runs in its own subprocess)
# ----------------------------------------------------------------------------------------------------------------- #


def _setup_torch(threads: int):
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    return torch


def _load_hf(torch, model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    return model


def _timed_hf_load(spec: dict):
    """(torch, the transformers model, its load seconds) for a worker."""
    torch = _setup_torch(spec["threads"])
    t = time.perf_counter()
    model = _load_hf(torch, spec["model_dir"])
    return torch, model, time.perf_counter() - t


def _pad_id(model) -> int:
    for v in (model.config.pad_token_id, model.generation_config.pad_token_id, model.config.eos_token_id, 0):
        if isinstance(v, list):
            v = v[0] if v else None
        if isinstance(v, int):
            return v
    return 0


def worker_tokenfleet(spec: dict, reqs: list[dict], warm: list[dict]) -> dict:
    torch = _setup_torch(spec["threads"])
    from tokenfleet import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(model=spec["model_dir"], **spec.get("tokenfleet_options", {}))
    load_s = time.perf_counter() - t

    def run(rs):
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rs]
        # token ids only, like the vLLM run (detokenize=False) and the transformers runs
        sps = [
            SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False) for r in rs
        ]
        outs = llm.generate(prompts, sps)
        return [list(o.token_ids) for o in outs]

    run(warm)
    from tokenfleet.engine.engine import StepStats

    llm.engine.stats = StepStats()
    outputs, wall, others = timed_run(run, reqs)
    stats = llm.engine.stats
    import tokenfleet

    version = getattr(tokenfleet, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as _v

            version = _v("tokenfleet")
        except Exception:  # noqa: BLE001
            version = "?"
    return {
        "wall_s": wall,
        "load_s": load_s,
        "outputs": outputs,
        "version": version,
        "torch": torch.__version__,
        "others_cpu": others,
        "notes": f"engine options {spec.get('tokenfleet_options', {})}; {stats.steps} steps: "
        f"scheduler {stats.schedule_s / stats.total_s:.1%}, batch preparation "
        f"{stats.prepare_s / stats.total_s:.1%}, model forward {stats.forward_s / stats.total_s:.1%}, "
        f"sampler {stats.sample_s / stats.total_s:.1%}, outputs {stats.output_s / stats.total_s:.1%} "
        f"of step time",
    }


def worker_hf_static(spec: dict, reqs: list[dict], warm: list[dict]) -> dict:
    import transformers
    from transformers import GenerationConfig

    torch, model, load_s = _timed_hf_load(spec)
    pad = _pad_id(model)
    bs = spec["hf_batch_size"]
    generated_total = [0]

    @torch.inference_mode()
    def run(rs):
        outs = []
        for s in range(0, len(rs), bs):
            batch = rs[s : s + bs]
            L = max(len(r["prompt_token_ids"]) for r in batch)
            ids = torch.full((len(batch), L), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), L), dtype=torch.long)
            for j, r in enumerate(batch):
                p = r["prompt_token_ids"]
                ids[j, L - len(p) :] = torch.tensor(p, dtype=torch.long)
                mask[j, L - len(p) :] = 1
            mx = max(r["max_tokens"] for r in batch)
            # eos_token_id=None: EOS neither stops a row nor is suppressed (= ignore_eos of vLLM/tokenfleet).
            # (min_new_tokens would also keep rows going, but it masks EOS out of the argmax, changing outputs.)
            gc = GenerationConfig(
                max_new_tokens=mx, do_sample=False, eos_token_id=None, pad_token_id=pad, bos_token_id=None
            )
            seq = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
            new = seq[:, L:]
            assert new.shape[1] == mx, (new.shape, mx)
            generated_total[0] += new.numel()
            for j, r in enumerate(batch):
                outs.append(new[j, : r["max_tokens"]].tolist())
        return outs

    model.generation_config.eos_token_id = None
    run(warm)
    generated_total[0] = 0
    outputs, wall, others = timed_run(run, reqs)
    return {
        "wall_s": wall,
        "load_s": load_s,
        "outputs": outputs,
        "generated_tokens": generated_total[0],
        "others_cpu": others,
        "version": transformers.__version__,
        "torch": torch.__version__,
        "notes": f"batch size {bs}, arrival order, left padding, sdpa; each batch runs max(max_tokens) steps",
    }


def worker_hf_cb(spec: dict, reqs: list[dict], warm: list[dict]) -> dict:
    torch = _setup_torch(spec["threads"])
    import transformers
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    t = time.perf_counter()
    model = _load_hf(torch, spec["model_dir"])
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kvh = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    page = 256
    bytes_per_block = cfg.num_hidden_layers * 2 * kvh * head_dim * 4 * page
    # Capacity: enough pages for every request of the workload at once (so, like vLLM with its 4 GiB here, it never
    # has to preempt), capped at --kv-cache-gib.  Not simply --kv-cache-gib: with SDPA its attention-mask reservation
    # grows with the cache size (4 GiB of cache -> a ~40 GB footprint for the small model -> MemoryError).
    need = sum(-(-(len(r["prompt_token_ids"]) + r["max_tokens"]) // page) for r in reqs + warm) + 2
    num_blocks = max(1, min(need, int(spec["kv_cache_gib"] * 2**30) // bytes_per_block))
    cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks)
    gc = GenerationConfig(
        max_new_tokens=max(r["max_tokens"] for r in reqs), do_sample=False, eos_token_id=-1, pad_token_id=_pad_id(model)
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(r["prompt_token_ids"]) for r in reqs),
        max_generated_length=max(r["max_tokens"] for r in reqs),
        num_requests=len(reqs),
    )
    timeout = spec.get("timeout", 3600)

    def run(manager, rs, tag):
        ids = []
        for i, r in enumerate(rs):
            rid = f"{tag}{i}"
            manager.add_request(
                input_ids=r["prompt_token_ids"], request_id=rid, max_new_tokens=r["max_tokens"], eos_token_id=-1
            )
            ids.append(rid)
        results = {}
        deadline = time.monotonic() + timeout
        while len(results) < len(rs):
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("continuous batching loop stopped")
                if time.monotonic() > deadline:
                    raise TimeoutError("hf_cb timed out")
                continue
            if res.is_finished():
                if res.error is not None:
                    raise RuntimeError(f"request {res.request_id} failed: {res.error}")
                results[res.request_id] = list(res.generated_tokens)
        return [results[i] for i in ids]

    with (
        torch.inference_mode(),
        model.continuous_batching_context_manager(
            generation_config=gc, continuous_batching_config=cb_config, workload_hints=hints, block=True, timeout=30
        ) as manager,
    ):
        load_s = time.perf_counter() - t
        run(manager, warm, "warm")
        outputs, wall, others = timed_run(run, manager, reqs, "req")
        cbc = manager.continuous_batching_config
        info = {
            k: getattr(cbc, k, None)
            for k in ("max_batch_tokens", "max_requests_per_batch", "num_blocks", "page_size", "use_async_batching")
        }
        info["attn_implementation"] = model.config._attn_implementation
    return {
        "wall_s": wall,
        "load_s": load_s,
        "outputs": outputs,
        "version": transformers.__version__,
        "torch": torch.__version__,
        "others_cpu": others,
        "notes": f"manager API with per-request max_new_tokens, eos_token_id=-1; "
        f"KV {num_blocks} blocks of {page} tokens ({num_blocks * bytes_per_block / 2**30:.2f} GiB, the whole "
        f"workload fits); config {info}",
    }


def _interp(grid: list[tuple[int, float]], b: int) -> float:
    """Linear interpolation of step time at batch b over (B, t) grid points (sorted by B)."""
    if b <= grid[0][0]:
        return grid[0][1]
    for (b0, t0), (b1, t1) in zip(grid, grid[1:]):
        if b <= b1:
            return t0 + (t1 - t0) * (b - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = grid[-2], grid[-1]  # extrapolate (should not happen: grid reaches len(reqs))
    return t1 + (t1 - t0) * (b - b1) / max(1, b1 - b0)


def worker_ceiling(spec: dict, reqs: list[dict], warm: list[dict]) -> dict:
    import transformers
    from transformers import StaticCache

    torch, model, load_s = _timed_hf_load(spec)
    n = len(reqs)
    plens = [len(r["prompt_token_ids"]) for r in reqs]
    olens = [r["max_tokens"] for r in reqs]
    ctx = int(round(statistics.mean(plens) + statistics.mean(olens) / 2))
    steps = spec["ceiling_steps"]
    gen = torch.Generator().manual_seed(0)
    upper = spec["id_upper"]

    probe = CpuProbe()
    probe.start()
    t_measure = time.perf_counter()
    with torch.inference_mode():
        # prefill rate: batch 1, real prompts, no padding, KV written into a DynamicCache, last-position logits only
        sample = reqs[: min(len(reqs), spec["ceiling_prefill_sample"])]
        for r in sample[:2]:  # warm-up
            model(input_ids=torch.tensor([r["prompt_token_ids"]]), use_cache=True, logits_to_keep=1)
        ptoks, ptime = 0, 0.0
        for r in sample:
            ids = torch.tensor([r["prompt_token_ids"]])
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            out.logits[:, -1].argmax(-1)
            ptime += time.perf_counter() - t0
            ptoks += ids.shape[1]
        prefill_tps = ptoks / ptime

        # decode step time on a grid of batch sizes
        grid_b = sorted(
            {b for b in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512] if b < n} | {n, spec["hf_batch_size"]} - {0}
        )
        grid_b = [b for b in grid_b if b <= n]
        grid = []
        for b in grid_b:
            cache = StaticCache(config=model.config, max_cache_len=ctx + steps + 3)
            tok = torch.randint(0, upper, (b, 1), generator=gen)
            times = []
            for s in range(steps + 2):
                pos = ctx + s
                t0 = time.perf_counter()
                out = model(
                    input_ids=tok,
                    past_key_values=cache,
                    use_cache=True,
                    cache_position=torch.tensor([pos]),
                    position_ids=torch.full((b, 1), pos),
                    logits_to_keep=1,
                )
                tok = out.logits[:, -1:].argmax(-1)
                times.append(time.perf_counter() - t0)
            grid.append((b, statistics.median(times[2:])))
            del cache

    others = probe.stop(time.perf_counter() - t_measure)
    decode_s = sum(_interp(grid, sum(1 for o in olens if o > k)) for k in range(max(olens)))
    prefill_s = sum(plens) / prefill_tps
    return {
        "wall_s": prefill_s + decode_s,
        "load_s": load_s,
        "outputs": None,
        "estimate": True,
        "others_cpu": others,
        "version": transformers.__version__,
        "torch": torch.__version__,
        "ceiling": {
            "context_len": ctx,
            "prefill_tokens_per_s": prefill_tps,
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "prefill_sample": len(sample),
            "decode_grid": [{"batch": b, "step_s": s, "tokens_per_s": b / s} for b, s in grid],
        },
        "notes": f"HF forward + argmax; StaticCache ctx {ctx}; estimated wall = prefill + sum_k t(B_k)",
    }


WORKERS = {
    "tokenfleet": worker_tokenfleet,
    "hf_static": worker_hf_static,
    "hf_cb": worker_hf_cb,
    "ceiling": worker_ceiling,
}


def worker_main(system: str, spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    wl = json.loads(Path(spec["workload_path"]).read_text())
    reqs = wl["requests"]
    warm = [
        {"prompt_token_ids": r["prompt_token_ids"], "max_tokens": spec["warmup_tokens"]}
        for r in reqs[: spec["warmup_requests"]]
    ]
    spec["id_upper"] = wl["id_upper"]
    res = WORKERS[system](spec, reqs, warm)
    res["system"] = system
    res["threads"] = spec["threads"]
    Path(out_path).write_text(json.dumps(res))


# ----------------------------------------------------------------------------------------------------------------- #
# orchestration
# ----------------------------------------------------------------------------------------------------------------- #


def run_system(system: str, args, spec_path: Path, run_dir: Path) -> tuple[dict | None, str]:
    out = run_dir / f"result_{system}.json"
    log = run_dir / f"log_{system}.txt"
    env = repo_env(args.threads)
    if system == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(args.kv_cache_gib))
        # vLLM binds its OpenMP threads itself.  Its "auto" default reserves one core for the front end and the
        # engine's busy loop (on 2 cores the model runs on 1).  Binding both cores ("all") was ~4x SLOWER here (the
        # spinning OpenMP threads fight the busy-polling processes), so the default keeps vLLM's own choice.
        if args.vllm_omp_bind == "all":
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
        elif args.vllm_omp_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_omp_bind
        # with OMP_NUM_THREADS set, vLLM keeps that many torch threads whatever the binding: leave it to vLLM
        env.pop("OMP_NUM_THREADS", None)
        env.pop("MKL_NUM_THREADS", None)
        if args.vllm_ld_preload:
            env["LD_PRELOAD"] = args.vllm_ld_preload
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        cmd = [args.vllm_python, str(HERE / "_vllm_worker.py"), str(spec_path), str(out)]
        if not Path(args.vllm_python).exists():
            return None, f"vLLM python {args.vllm_python} not found (run bench/setup_peers.sh)"
    else:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            system,
            "--spec",
            str(spec_path),
            "--result",
            str(out),
        ]
    busy = wait_idle(args.wait_idle, system)
    print(f"[{system}] running ... (log: {log}; CPU busy before start {100 * busy:.0f}%)", flush=True)
    t = time.perf_counter()
    with open(log, "w") as f:
        try:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=args.timeout)
            rc = r.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    took = time.perf_counter() - t
    if rc != 0 or not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        print(f"[{system}] FAILED (rc={rc}, {took:.0f}s); last log lines:\n    " + "\n    ".join(tail), flush=True)
        last = next((ln for ln in reversed(tail) if ln.strip()), "")
        return None, f"failed (rc={rc}): {last[-200:]}"
    res = json.loads(out.read_text())
    res["cpu_busy_before_start"] = busy
    oc = res.get("others_cpu")
    print(
        f"[{system}] done in {took:.0f}s (generation {res['wall_s']:.2f}s"
        + (f", other processes used {100 * oc:.0f}% of the CPUs meanwhile" if oc is not None else "")
        + ")"
        + (" -- WARNING: contended, timing unreliable" if (oc or 0) > CONTENDED else ""),
        flush=True,
    )
    return res, "ok"


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    exact, prefix_frac = 0, []
    for x, y in zip(a, b):
        exact += x == y
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix_frac.append(k / max(1, max(len(x), len(y))))
    return {"exact": exact, "n": len(a), "mean_common_prefix": statistics.mean(prefix_frac) if prefix_frac else 0.0}


def machine_info(args) -> dict:
    return {
        "cores": os.cpu_count(),
        "threads_used": args.threads,
        "cpu": cpu_model(),
        "memory": memory_total(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(report, indent=1))
    m, w, c = report["machine"], report["workload"], report["checkpoint"]
    L = [
        f"# Offline throughput — {report['date']}",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), {m['memory']} RAM, torch threads {m['threads_used']}; "
        f"Python {m['python']}; versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        "",
        f"Checkpoint: `{c['dir']}` — {c['source']}; {c['info'].get('parameters', 0) / 1e6:.1f}M parameters "
        f"(hidden {c['info'].get('hidden_size')}, layers {c['info'].get('num_hidden_layers')}, "
        f"heads {c['info'].get('num_attention_heads')}/{c['info'].get('num_key_value_heads')} kv, "
        f"vocab {c['info'].get('vocab_size')}), float32.",
        "",
        f"Workload: {w['num_requests']} requests, seed {w['seed']}, prompt lengths uniform "
        f"[{w['prompt_min']}, {w['prompt_max']}] (total {w['prompt_tokens']}), output lengths uniform "
        f"[{w['output_min']}, {w['output_max']}] (total {w['output_tokens']}), ignore_eos, greedy; random prompt "
        f"token ids (no special tokens). Warm-up: first {w['warmup_requests']} prompts x {w['warmup_tokens']} "
        f'tokens, not timed. Timed: generation only (model load excluded). "Other CPU load": CPU time used by '
        f"processes outside the benchmark during the timed window, as a share of all cores (>{100 * CONTENDED:.0f}%: "
        f"timing unreliable).",
        "",
        "| system | wall s | output tok/s | total tok/s | req/s | output tok/s vs vLLM | other CPU load | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in report["systems"]:
        if s["status"] != "ok":
            L.append(f"| {s['label']} | — | — | — | — | — | — | {s['status']} |")
            continue
        ratio = f"{s['ratio_vs_vllm']:.2f}x" if s.get("ratio_vs_vllm") is not None else "—"
        oc = f"{100 * s['others_cpu']:.0f}%" if s.get("others_cpu") is not None else "?"
        L.append(
            f"| {s['label']} | {s['wall_s']:.2f} | {s['output_tok_s']:.1f} | {s['total_tok_s']:.1f} | "
            f"{s['req_s']:.2f} | {ratio} | {oc} | {s['short_note']} |"
        )
    ceil = next((s for s in report["systems"] if s["system"] == "ceiling" and s["status"] == "ok"), None)
    if ceil:
        cz = ceil["ceiling"]
        L += [
            "",
            "Model-forward ceiling (transformers forward + argmax only; an estimate, not a run): prefill "
            f"{cz['prefill_tokens_per_s']:.0f} prompt tok/s (batch 1, {cz['prefill_sample']} workload prompts) -> "
            f"{cz['prefill_s']:.2f} s; decode against a static KV cache of {cz['context_len']} positions, ideal "
            f"schedule (all requests admitted at once, step k batch = #requests with max_tokens > k) -> "
            f"{cz['decode_s']:.2f} s.",
            "",
            "| decode batch B | step ms | decode tok/s (B / step) |",
            "|---:|---:|---:|",
        ]
        for g in cz["decode_grid"]:
            L.append(f"| {g['batch']} | {g['step_s'] * 1e3:.2f} | {g['tokens_per_s']:.0f} |")
    if report["crosscheck"]:
        L += [
            "",
            f"Greedy-output cross-check against {report['crosscheck_reference']} (random weights: near-flat "
            "logits, so numeric noise can flip an argmax):",
            "",
            "| system | identical outputs | mean common-prefix fraction |",
            "|---|---:|---:|",
        ]
        for name, cc in report["crosscheck"].items():
            L.append(f"| {LABELS.get(name, name)} | {cc['exact']}/{cc['n']} | {cc['mean_common_prefix']:.3f} |")
    L += ["", "System details:", ""]
    for s in report["systems"]:
        L.append(f"- **{s['label']}**: {s.get('notes', '')}")
    L += ["", "Methodology: see the docstring of `bench/offline_throughput.py`.", ""]
    path.write_text("\n".join(L))
    print(f"wrote {path} and {path.with_suffix('.json')}")


def main(argv=None) -> None:
    p = bench_parser(__doc__)
    add_checkpoint_args(p, "checkpoints", builtin_help="do not try `tokenfleet demo-model`; build the checkpoint here")
    p.add_argument("--num-requests", type=int, default=200)
    add_length_args(p)
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS))
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--kv-cache-gib", type=float, default=4, help="KV cache size for vLLM and transformers CB")
    p.add_argument("--tokenfleet-options", default="{}", help="JSON dict of LLM(...) engine options")
    p.add_argument("--vllm-python", default="/tmp/vllm/bin/python")
    p.add_argument(
        "--vllm-omp-bind",
        default="auto",
        help="VLLM_CPU_OMP_THREADS_BIND: 'auto' = vLLM's default (default; on 2 cores it runs the model on "
        "1 core and keeps 1 for its front end / engine loop), 'all' = cores 0..threads-1, or an "
        "explicit list such as 0-1",
    )
    p.add_argument("--vllm-ld-preload", default="", help="LD_PRELOAD for the vLLM process (e.g. its libiomp5.so)")
    p.add_argument("--warmup-requests", type=int, default=8)
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument("--ceiling-steps", type=int, default=5)
    p.add_argument("--ceiling-prefill-sample", type=int, default=16)
    p.add_argument(
        "--wait-idle",
        type=int,
        default=300,
        help="before each system, wait up to this many seconds for other work on the machine to stop",
    )
    p.add_argument("--timeout", type=int, default=7200, help="per-system timeout, seconds")
    p.add_argument("--out", default="docs/benchmarks/offline_throughput.md", help="'' = no report files")
    p.add_argument("--run-dir", help="where workload, logs and raw results go (default: a new temp dir)")
    # internal
    p.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--build-checkpoint", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        return worker_main(args.worker, args.spec, args.result)
    if args.build_checkpoint:
        return build_checkpoint(Path(args.build_checkpoint), args.size)

    systems = known_names(p, args.systems, ALL_SYSTEMS, "systems")
    command = command_line(__file__)

    model_dir, source = ensure_checkpoint(args)
    info = checkpoint_info(model_dir)
    print(f"checkpoint: {model_dir} ({source}; {info['parameters'] / 1e6:.1f}M params)")
    run_dir = make_run_dir(args.run_dir, "tokenfleet-bench-")
    wl = make_workload(args, model_dir)
    wl_path = run_dir / "workload.json"
    wl_path.write_text(json.dumps(wl))
    reqs = wl["requests"]
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
    output_tokens = sum(r["max_tokens"] for r in reqs)
    print(f"workload: {len(reqs)} requests, {prompt_tokens} prompt + {output_tokens} output tokens -> {wl_path}")
    spec = {
        "model_dir": str(model_dir),
        "workload_path": str(wl_path),
        "threads": args.threads,
        "hf_batch_size": args.hf_batch_size,
        "kv_cache_gib": args.kv_cache_gib,
        "tokenfleet_options": json.loads(args.tokenfleet_options),
        "warmup_requests": args.warmup_requests,
        "warmup_tokens": args.warmup_tokens,
        "ceiling_steps": args.ceiling_steps,
        "ceiling_prefill_sample": args.ceiling_prefill_sample,
        "max_model_len": wl["max_model_len"],
        "timeout": args.timeout,
    }
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))

    results = {}
    rows = []
    for s in systems:
        res, status = run_system(s, args, spec_path, run_dir)
        row = {"system": s, "label": LABELS[s], "status": status}
        if res is not None:
            results[s] = res
            wall = res["wall_s"]
            row.update(
                wall_s=wall,
                load_s=res.get("load_s"),
                output_tok_s=output_tokens / wall,
                total_tok_s=(prompt_tokens + output_tokens) / wall,
                req_s=len(reqs) / wall,
                notes=res.get("notes", ""),
                version=res.get("version"),
                cpu_busy_before_start=res["cpu_busy_before_start"],
                others_cpu=res.get("others_cpu"),
            )
            short = []
            if (res.get("others_cpu") or 0) > CONTENDED:
                short.append("WARNING: other processes competed for the CPUs")
            if res.get("outputs") is not None:
                lens_ok = all(len(o) == r["max_tokens"] for o, r in zip(res["outputs"], reqs)) and len(
                    res["outputs"]
                ) == len(reqs)
                row["lengths_ok"] = lens_ok
                if not lens_ok:
                    short.append("WRONG OUTPUT LENGTHS")
            if res.get("generated_tokens"):
                g = res["generated_tokens"]
                short.append(f"{g} tokens generated, {100 * (1 - output_tokens / g):.0f}% wasted")
            if res.get("estimate"):
                short.append("estimate: prefill + decode-step profile")
                row["ceiling"] = res["ceiling"]
            row["short_note"] = "; ".join(short)
        rows.append(row)

    vllm_row = next((r for r in rows if r["system"] == "vllm" and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] == "ok" and vllm_row:
            r["ratio_vs_vllm"] = r["output_tok_s"] / vllm_row["output_tok_s"]

    ref = next((s for s in ("hf_static", "hf_cb") if results.get(s, {}).get("outputs") is not None), None)
    cross = {}
    if ref:
        for s in systems:
            if s != ref and results.get(s, {}).get("outputs") is not None:
                cross[s] = compare(results[s]["outputs"], results[ref]["outputs"])

    print(
        f"\n{'system':<34} {'wall s':>9} {'out tok/s':>12} {'total tok/s':>12} {'req/s':>8} {'vs vLLM':>8} "
        f"{'others':>6}"
    )
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['label']:<34} {r['status']}")
            continue
        ratio = f"{r['ratio_vs_vllm']:.2f}x" if r.get("ratio_vs_vllm") is not None else "-"
        oc = f"{100 * r['others_cpu']:.0f}%" if r.get("others_cpu") is not None else "?"
        print(
            f"{r['label']:<34} {r['wall_s']:>9.2f} {r['output_tok_s']:>12.1f} {r['total_tok_s']:>12.1f} "
            f"{r['req_s']:>8.2f} {ratio:>8} {oc:>6}  {r.get('short_note', '')}"
        )
    if cross:
        print(f"\ngreedy outputs vs {LABELS[ref]}:")
        for s, cc in cross.items():
            print(
                f"  {LABELS[s]:34s} identical {cc['exact']}/{cc['n']}, mean common prefix "
                f"{cc['mean_common_prefix']:.3f}"
            )
    print(f"\nrun dir (workload, logs, raw results): {run_dir}")

    if args.out:
        versions = {}
        for s in ("tokenfleet", "hf_static", "hf_cb", "ceiling", "vllm"):
            if s in results:
                key = {"hf_static": "transformers", "hf_cb": "transformers", "ceiling": "transformers"}.get(s, s)
                versions[key] = results[s].get("version")
                if s != "vllm":
                    versions["torch"] = results[s].get("torch")
                else:
                    versions["torch (vLLM venv)"] = results[s].get("torch")
        report = {
            "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
            "command": command,
            "machine": machine_info(args),
            "versions": versions,
            "checkpoint": {"dir": str(model_dir), "source": source, "info": info},
            "workload": {
                "num_requests": len(reqs),
                "seed": args.seed,
                "prompt_min": args.prompt_min,
                "prompt_max": args.prompt_max,
                "output_min": args.output_min,
                "output_max": args.output_max,
                "prompt_tokens": prompt_tokens,
                "output_tokens": output_tokens,
                "warmup_requests": args.warmup_requests,
                "warmup_tokens": args.warmup_tokens,
            },
            "systems": rows,
            "crosscheck_reference": LABELS.get(ref, ref),
            "crosscheck": cross,
            "run_dir": str(run_dir),
        }
        write_report((REPO / args.out) if not os.path.isabs(args.out) else Path(args.out), report)


if __name__ == "__main__":
    main()
