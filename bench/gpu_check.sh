#!/usr/bin/env bash
# The engine levers on a lent GPU, in a few minutes (issue 19): run from the repository root,
#
#     bash bench/gpu_check.sh            # results also under $OUT (when set) or /tmp/gpu_check
#
# 1. install: tokenfleet from this checkout on the python3 that holds CUDA PyTorch (PYTHONPATH, nothing fetched);
#    wheels of missing packages, if carried in .whl/, are installed into /tmp/site first;
# 2. stop here, saying so, where PyTorch sees no CUDA device (exit 0: nothing to check);
# 3. the CUDA tests of the levers: FP8 KV cache, quantized checkpoints, speculative decoding, the NCCL collectives
#    of tensor parallelism in a one-rank group, P/D (a prefill and a decode engine on one GPU moving KV blocks)
#    (tests/engine/test_levers_gpu.py; no conftest: the store fixtures need packages the GPU image lacks);
# 4. a tiny throughput number: the demo medium checkpoint in bf16 on the GPU, KV cache bf16 vs fp8_e4m3, offline
#    greedy decoding of 256 requests (512-token prompts, 128 tokens each).
# Each step has its own time limit; all of it stays under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-/tmp/gpu_check}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
started=$(date +%s)
say() { echo "[gpu_check +$(($(date +%s) - started))s] $*" | tee -a "$RESULTS/gpu_check.log"; }

if compgen -G ".whl/*.whl" >/dev/null; then
    say "installing carried wheels into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { say "FAILED: the carried wheels did not install"; exit 1; }
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1

if ! "$PY" -c "import tokenfleet, transformers, safetensors, tokenizers, pytest" 2>>"$RESULTS/gpu_check.log"; then
    say "FAILED: a package tokenfleet or its tests need is missing (see $RESULTS/gpu_check.log); carry it in .whl/"
    exit 1
fi
device=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>&1)
if [ -z "$device" ]; then
    say "no CUDA device: PyTorch $("$PY" -c 'import torch; print(torch.__version__)') sees none, so there is nothing to check here (run this on a lent GPU)"
    exit 0
fi
say "device: $device; torch $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)')"

say "CUDA tests of the levers"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider --noconftest tests/engine/test_levers_gpu.py \
    --basetemp=/tmp/gpu_check_pytest --junitxml="$RESULTS/levers_gpu.xml" 2>&1 | tee "$RESULTS/levers_gpu.txt"
tests_rc=${PIPESTATUS[0]}
say "tests exit code $tests_rc"

say "throughput: bf16 vs fp8_e4m3 KV cache"
timeout 180 "$PY" - "$RESULTS/throughput.json" <<'EOF' 2>&1 | tee -a "$RESULTS/gpu_check.log"
import gc, json, random, sys, tempfile, time

import torch

from tokenfleet import LLM, SamplingParams
from tokenfleet.model.demo import write_demo_checkpoint

path = write_demo_checkpoint(tempfile.mkdtemp(prefix="gpu-check-") + "/medium", "medium")
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(512)]} for _ in range(256)]
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
rows = []
for kv in ("auto", "fp8_e4m3"):
    llm = LLM(str(path), dtype="bfloat16", kv_cache_dtype=kv, device="cuda", gpu_memory_utilization=0.3,
              max_num_seqs=256, max_num_batched_tokens=8192, skip_tokenizer_init=True)
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    row = {"kv_cache_dtype": kv, "kv_cache_tokens": llm.engine.runner.kv_cache_tokens, "wall_s": wall,
           "output_tokens_per_s": tokens / wall}
    rows.append(row)
    print(json.dumps(row), flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, open(sys.argv[1], "w"), indent=1)
EOF
bench_rc=${PIPESTATUS[0]}
say "throughput exit code $bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
