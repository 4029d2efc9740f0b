"""Greedy output equals transformers' generate, whatever the scheduling: alone, batched, chunked, cached, preempted."""

from __future__ import annotations

import random

import pytest
import torch

from tests.checkpoints import ARCHITECTURES, SMALL_KV, load_reference, make_checkpoint, reference_greedy
from tokenfleet import LLM, SamplingParams
from tokenfleet.engine.request import RequestStatus

KIB_BLOCK = 1 / (1 << 20)  # kv_cache_gib per KiB


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return path, load_reference(path)


def random_prompts(count: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def check_against_reference(llm: LLM, reference, prompts: list[list[int]], max_tokens: list[int]) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(m) for m in max_tokens])
    for prompt, n, out in zip(prompts, max_tokens, outputs):
        assert out.token_ids == reference_greedy(reference, prompt, n), f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"
    return outputs


def test_alone(checkpoint):
    path, reference = checkpoint
    llm = LLM(str(path), skip_tokenizer_init=True, **SMALL_KV)
    for prompt in random_prompts(2, 1, 40, seed=1):
        check_against_reference(llm, reference, [prompt], [12])


def test_busy_mixed_batch_with_chunked_prefill(checkpoint):
    path, reference = checkpoint
    llm = LLM(str(path), skip_tokenizer_init=True, max_num_batched_tokens=48, max_num_seqs=6, **SMALL_KV)
    prompts = random_prompts(10, 3, 120, seed=2)
    check_against_reference(llm, reference, prompts, [random.Random(i).randint(4, 20) for i in range(10)])


def test_prefix_cache_hit(checkpoint):
    path, reference = checkpoint
    llm = LLM(str(path), skip_tokenizer_init=True, **SMALL_KV)
    shared = random_prompts(1, 70, 70, seed=3)[0]
    check_against_reference(llm, reference, [shared + [5, 6, 7]], [8])
    second = check_against_reference(llm, reference, [shared + [9, 10]], [8])[0]
    assert second.num_cached_tokens == 64  # four full 16-token blocks of the shared prefix


@pytest.mark.parametrize("swap_threshold", [10_000, 16], ids=["recompute", "swap"])
def test_preemption(checkpoint, swap_threshold):
    path, reference = checkpoint
    # 8 KiB blocks (2 layers x 2 KV heads x 16 dims x fp32 x 16 tokens x K,V): 12 blocks for 8 requests of 5 each
    kv_block_bytes = 2 * 2 * 2 * 16 * 4 * 16 * (2 if "qwen3" in str(path) else 1)
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        kv_cache_gib=12 * kv_block_bytes / (1 << 30),
        watermark=0.0,
        swap_threshold_tokens=swap_threshold,
        swap_space_gib=SMALL_KV["swap_space_gib"],
    )
    prompts = random_prompts(8, 20, 40, seed=4)
    seen = []
    original_preempt = llm.engine.scheduler._preempt

    def spy(req, out):
        refund = original_preempt(req, out)
        seen.append(req.status)
        return refund

    llm.engine.scheduler._preempt = spy
    check_against_reference(llm, reference, prompts, [30] * 8)
    expected = RequestStatus.SWAPPED if swap_threshold == 16 else RequestStatus.WAITING
    assert expected in seen, f"no preemption by {'swap' if swap_threshold == 16 else 'recompute'} happened"
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_dtypes_run(tmp_path):
    path = make_checkpoint(tmp_path, "llama", dtype=torch.bfloat16)
    for dtype in ("bfloat16", "float16", "float32"):
        llm = LLM(str(path), skip_tokenizer_init=True, dtype=dtype, **SMALL_KV)
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(4))[0]
        assert len(out.token_ids) == 4
        assert next(llm.engine.model.parameters()).dtype == getattr(torch, dtype)
