"""The engine levers on CUDA (issue 19): an FP8 KV cache, quantized checkpoints and speculative decoding give the
same greedy tokens as their references when the engine runs on a GPU. Skipped where there is no CUDA device;
bench/gpu_check.sh runs them on a lent GPU."""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
import torch

from tests.checkpoints import load_reference, make_checkpoint, reference_greedy
from tests.quantized_checkpoints import FORMATS, write_online_reference, write_quantized
from tokenfleet import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.sh)")

# A tenth of the GPU for each engine's KV cache, not the default 90%: several engines live in one test session.
ON_CUDA = dict(device="cuda", gpu_memory_utilization=0.1, swap_space_gib=0.01, skip_tokenizer_init=True)


def prompts(count: int, seed: int = 0, repeat: bool = False) -> list[list[int]]:
    """Random token ids; with `repeat`, each prompt is a phrase said twice, so an n-gram lookup has something to
    propose."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        phrase = [rng.randrange(3, 384) for _ in range(rng.randint(6, 24))]
        out.append(phrase * 2 if repeat else phrase)
    return out


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def generate(llm: LLM, token_prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in token_prompts], greedy(max_tokens))
    return [out.token_ids for out in outputs]


def free_cuda_cache() -> None:
    """After the caller's `del` of its last engine: the engine's KV cache goes back to the device."""
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gpu-llama") / "llama", "llama")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_equals_the_round_tripping_reference(arch, kv_cache_dtype, tmp_path):
    from tests.engine.test_fp8_kv_cache import RoundTripCache

    path = make_checkpoint(tmp_path / arch, arch)
    llm = LLM(str(path), kv_cache_dtype=kv_cache_dtype, **ON_CUDA)
    runner = llm.engine.runner
    assert runner.kv_cache.device.type == "cuda" and runner.kv_cache.element_size() == 1
    reference = load_reference(path).to("cuda")
    cases = prompts(6, seed=1)
    got = generate(llm, cases, 12)  # one busy batch
    for prompt, tokens in zip(cases, got):
        assert tokens == reference_greedy(reference, prompt, 12, RoundTripCache(runner.kv_scales, runner.kv_dtype))
    del llm, runner
    free_cuda_cache()


def test_fp8_kv_cache_holds_twice_the_tokens_of_bf16(llama):
    bf16 = LLM(str(llama), dtype="bfloat16", **ON_CUDA)
    bf16_bytes = bf16.engine.runner.kv_cache.nbytes / bf16.engine.runner.num_blocks
    del bf16
    free_cuda_cache()
    fp8 = LLM(str(llama), dtype="bfloat16", kv_cache_dtype="fp8_e4m3", **ON_CUDA)
    fp8_bytes = fp8.engine.runner.kv_cache.nbytes / fp8.engine.runner.num_blocks
    del fp8
    free_cuda_cache()
    assert bf16_bytes == 2 * fp8_bytes


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_checkpoint_equals_its_dequantized_reference(llama, fmt, tmp_path):
    quantized, dequantized = write_quantized(llama, tmp_path / fmt, fmt)
    llm = LLM(str(quantized), **ON_CUDA)
    reference = load_reference(dequantized).to("cuda")
    cases = prompts(4, seed=2)
    for prompt, tokens in zip(cases, generate(llm, cases, 8)):
        assert tokens == reference_greedy(reference, prompt, 8)
    del llm
    free_cuda_cache()


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_online_quantization_equals_its_reference(llama, method, tmp_path):
    dequantized = write_online_reference(llama, tmp_path / "reference", method)
    llm = LLM(str(llama), quantization=method, **ON_CUDA)
    reference = load_reference(dequantized).to("cuda")
    cases = prompts(4, seed=3)
    for prompt, tokens in zip(cases, generate(llm, cases, 8)):
        assert tokens == reference_greedy(reference, prompt, 8)
    del llm
    free_cuda_cache()


@pytest.fixture(scope="module")
def repetitive_llama(tmp_path_factory) -> Path:
    """Small weights: greedy outputs fall into loops, so n-gram lookup has proposals the target accepts."""
    from tests.engine.test_speculative import REPETITIVE

    return make_checkpoint(tmp_path_factory.mktemp("gpu-llama-rep") / "llama", "llama", **REPETITIVE)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_gives_the_same_greedy_tokens(repetitive_llama, method):
    llama = repetitive_llama
    config = (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
        if method == "ngram"
        else {"method": "draft_model", "model": str(llama), "num_speculative_tokens": 3}
    )
    cases = prompts(8, seed=4, repeat=True)
    plain = LLM(str(llama), **ON_CUDA)
    expected = generate(plain, cases, 24)
    del plain
    free_cuda_cache()
    speculative = LLM(str(llama), speculative_config=config, **ON_CUDA)
    assert generate(speculative, cases, 24) == expected
    stats = speculative.engine.speculator.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    del speculative
    free_cuda_cache()


def test_nccl_collectives_of_a_one_rank_group():
    """The NCCL code path of tensor parallelism (engine/tensor_parallel.py), with the one GPU a check machine has:
    a one-rank group's all-reduce leaves the tensor as it is, its gather returns it."""
    from torch.distributed import TCPStore

    from tokenfleet.engine.tensor_parallel import ProcessGroupCollectives

    store = TCPStore("127.0.0.1", 0, 1, is_master=True)
    collectives = ProcessGroupCollectives(store, 0, 1, torch.device("cuda"))
    tensor = torch.arange(12, dtype=torch.bfloat16, device="cuda").reshape(3, 4)
    expected = tensor.clone()
    collectives.all_reduce(tensor)
    torch.cuda.synchronize()
    assert torch.equal(tensor, expected)
    gathered = collectives.gather_to_first(tensor)
    assert gathered is not None and torch.equal(gathered[0], expected)


def test_disaggregated_prefill_and_decode_between_two_engines_on_one_gpu(tmp_path):
    """Two engines on the GPU as a prefill and a decode replica hold them: the prefill one exports each chunk's
    blocks from device memory, the decode one writes them into its cache and decodes exactly as alone."""
    from tokenfleet.engine.config import EngineConfig
    from tokenfleet.engine.engine import Engine

    path = make_checkpoint(tmp_path / "llama", "llama", dtype=torch.bfloat16)
    options = dict(ON_CUDA, dtype="bfloat16", max_num_batched_tokens=64)
    prefill, decode = Engine(EngineConfig.from_options(str(path), **options)), None
    token_ids = prompts(1, seed=3)[0] * 8
    prefill.add_request(token_ids, SamplingParams(max_tokens=1, temperature=0.0, kv_export=True), request_id="p")
    chunks = []
    while prefill.has_unfinished():
        chunks += [o.kv_chunk for o in prefill.step() if o.kv_chunk is not None]
    assert len(chunks) >= 2
    decode = Engine(EngineConfig.from_options(str(path), **options))
    for chunk in chunks:
        decode.kv_exchange.import_chunk(token_ids, chunk)
    decode.add_request(token_ids, greedy(16), request_id="d")
    out = None
    while decode.has_unfinished():
        out = next((o for o in decode.step() if o.finished), out)
    assert out is not None and out.num_cached_tokens == chunks[-1].end_block * 16
    prefill.add_request(token_ids, greedy(16), request_id="alone")  # its own prefix cache: the same blocks
    alone = None
    while prefill.has_unfinished():
        alone = next((o for o in prefill.step() if o.finished), alone)
    assert alone is not None and out.token_ids == alone.token_ids
