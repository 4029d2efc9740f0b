"""An 8-bit (FP8) KV cache: greedy output equals transformers' generate when transformers' own cache rounds every
key and value through the same FP8 format and scales (alone, batched, chunked, cached, swapped, cancelled around),
the same budget holds 4x the blocks of a float32 cache and 2x of a bf16 one, and bad settings fail at start."""

from __future__ import annotations

import argparse
import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from tests.checkpoints import ARCHITECTURES, SMALL_KV, load_reference, make_checkpoint, reference_greedy
from tokenfleet import LLM, SamplingParams
from tokenfleet.engine.config import EngineConfig, add_engine_arguments
from tokenfleet.engine.request import RequestStatus
from tokenfleet.engine.runner import measure_kv_ranges
from tokenfleet.engine.state import load_report
from tokenfleet.model.attention import DecodeGroup, PagedAttention
from tokenfleet.model.config import ModelConfig
from tokenfleet.model.cpu_kernels import paged_decode_attention_op
from tokenfleet.model.kv_quant import KVScales, as_bytes

GIB = 1 << 30
FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def round_trip(x: torch.Tensor, scale: float, fmt: torch.dtype) -> torch.Tensor:
    """What reading back an 8-bit cache gives: x / scale saturated to the format's range and rounded, times scale."""
    limit = torch.finfo(fmt).max
    return (x.float() / scale).clamp(-limit, limit).to(fmt).to(x.dtype) * scale


class RoundTripCache(DynamicCache):
    """transformers' cache, storing each new key and value as the engine's 8-bit cache would."""

    def __init__(self, scales: list[KVScales], fmt: torch.dtype) -> None:
        super().__init__()
        self.scales, self.fmt = scales, fmt

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        scales = self.scales[layer_idx]
        return super().update(
            round_trip(key_states, scales.k, self.fmt),
            round_trip(value_states, scales.v, self.fmt),
            layer_idx,
            *args,
            **kwargs,
        )


def reference_greedy_fp8(model, prompt: list[int], max_new_tokens: int, llm: LLM) -> list[int]:
    runner = llm.engine.runner
    return reference_greedy(model, prompt, max_new_tokens, RoundTripCache(runner.kv_scales, runner.kv_dtype))


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
        assert out.token_ids == reference_greedy_fp8(reference, prompt, n, llm), (
            f"prompt of {len(prompt)} tokens diverged"
        )
        assert out.finish_reason == "length"
    return outputs


def fp8_llm(path, kv_cache_dtype: str = "fp8_e4m3", **options) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, kv_cache_dtype=kv_cache_dtype, **{**SMALL_KV, **options})


def block_bytes(path, dtype: torch.dtype, block_size: int = 16) -> int:
    return block_size * ModelConfig.from_dir(path).kv_bytes_per_token(dtype)


# --- output equals the round-tripping reference ----------------------------------------------------------------


def variant_on_one_architecture(request) -> None:
    """Variants that exercise the same code whatever the architecture run on one (CI's time); the default variant
    of each test runs on all."""
    if request.node.callspec.params["checkpoint"] != "llama":
        pytest.skip("this variant runs on the llama checkpoint only")


@pytest.mark.parametrize("kv_cache_dtype", sorted(FORMATS))
def test_alone(checkpoint, kv_cache_dtype, request):
    if kv_cache_dtype != "fp8_e4m3":
        variant_on_one_architecture(request)
    path, reference = checkpoint
    llm = fp8_llm(path, kv_cache_dtype)
    assert llm.engine.runner.kv_cache.dtype == FORMATS[kv_cache_dtype]
    for prompt in random_prompts(2, 1, 40, seed=1):
        check_against_reference(llm, reference, [prompt], [12])


@pytest.mark.parametrize("decode_path", ["kernel", "torch"])
def test_busy_mixed_batch_with_chunked_prefill(checkpoint, decode_path, request):
    if decode_path == "torch":
        variant_on_one_architecture(request)
    path, reference = checkpoint
    llm = fp8_llm(path, max_num_batched_tokens=48, max_num_seqs=6)
    if decode_path == "torch":
        llm.engine.runner.use_decode_kernel(None)
    else:
        assert llm.engine.runner.decode_kernel is not None, "the CPU kernel failed to build"
    prompts = random_prompts(10, 3, 120, seed=2)
    check_against_reference(llm, reference, prompts, [random.Random(i).randint(4, 20) for i in range(10)])


def test_prefix_cache_hit(checkpoint):
    path, reference = checkpoint
    llm = fp8_llm(path)
    shared = random_prompts(1, 70, 70, seed=3)[0]
    check_against_reference(llm, reference, [shared + [5, 6, 7]], [8])
    second = check_against_reference(llm, reference, [shared + [9, 10]], [8])[0]
    assert second.num_cached_tokens == 64  # four full 16-token blocks of the shared prefix, read back from 8 bits


@pytest.mark.parametrize("swap_threshold", [10_000, 16], ids=["recompute", "swap"])
def test_preemption(checkpoint, swap_threshold, request):
    if swap_threshold != 16:
        variant_on_one_architecture(request)
    path, reference = checkpoint
    # 12 blocks for 8 requests of 5 each, and host swap space in the same 8-bit blocks
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        kv_cache_dtype="fp8_e4m3",
        watermark=0.0,
        kv_cache_gib=12 * block_bytes(path, torch.float8_e4m3fn) / GIB,
        swap_threshold_tokens=swap_threshold,
        swap_space_gib=SMALL_KV["swap_space_gib"],
    )
    assert llm.engine.runner.num_blocks == 12 and llm.engine.runner.host_cache.dtype == torch.float8_e4m3fn
    seen = []
    original_preempt = llm.engine.scheduler._preempt

    def spy(req, out):
        refund = original_preempt(req, out)
        seen.append(req.status)
        return refund

    llm.engine.scheduler._preempt = spy
    check_against_reference(llm, reference, random_prompts(8, 20, 40, seed=4), [30] * 8)
    expected = RequestStatus.SWAPPED if swap_threshold == 16 else RequestStatus.WAITING
    assert expected in seen, f"no preemption by {'swap' if swap_threshold == 16 else 'recompute'} happened"
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_cancelled_requests_leave_the_others_exact(tmp_path):
    path = make_checkpoint(tmp_path, "qwen2")
    reference = load_reference(path)
    llm = fp8_llm(path, max_num_batched_tokens=32, max_num_seqs=4)
    engine = llm.engine
    prompts = random_prompts(4, 20, 60, seed=5)
    requests = [engine.add_request(p, greedy(10)) for p in prompts]
    for _ in range(3):
        engine.step()
    for req in requests[::2]:
        assert engine.abort(req.request_id)
    while engine.has_unfinished():
        engine.step()
    for prompt, req in zip(prompts[1::2], requests[1::2]):
        assert req.output_token_ids == reference_greedy_fp8(reference, prompt, 10, llm)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_scales_follow_the_models_range(tmp_path):
    """Keys 64x larger and queries 64x smaller are the same model: the key scales grow 64x, the stored bytes and the
    tokens stay the same. A fixed scale of 1 would saturate these keys at 448."""
    path = make_checkpoint(tmp_path / "plain", "llama")
    scaled = make_checkpoint(tmp_path / "scaled", "llama")
    weights = load_file(scaled / "model.safetensors")
    for name in weights:
        if name.endswith("k_proj.weight"):
            weights[name] = weights[name] * 64
        elif name.endswith("q_proj.weight"):
            weights[name] = weights[name] / 64
    save_file(weights, scaled / "model.safetensors", {"format": "pt"})
    plain_llm, scaled_llm = fp8_llm(path), fp8_llm(scaled)
    plain_runner, scaled_runner = plain_llm.engine.runner, scaled_llm.engine.runner
    for plain, big in zip(plain_runner.kv_scales, scaled_runner.kv_scales):
        assert big == KVScales(plain.k * 64, plain.v)
    key_ranges = [k for k, _ in measure_kv_ranges(scaled_llm.engine.model, torch.device("cpu"), 16, 256)]
    assert max(key_ranges) > 448, "the test needs keys beyond the e4m3 range"
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 10, 50, seed=6)]
    assert [o.token_ids for o in plain_llm.generate(prompts, greedy(12))] == [
        o.token_ids for o in scaled_llm.generate(prompts, greedy(12))
    ]
    assert torch.equal(as_bytes(plain_runner.kv_cache), as_bytes(scaled_runner.kv_cache))


# --- the CPU kernel reads 8-bit blocks --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_kernel_and_torch_path_dequantize_what_they_read(fmt, dtype, tol):
    kernel = paged_decode_attention_op()
    assert kernel is not None, "the CPU kernel failed to build on this machine (see the log warning)"
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block, num_blocks, n = 6, 2, 32, 16, 40, 7
    keys = torch.randn(kv_heads, num_blocks, block, dim, generator=gen) * 20
    values = torch.randn(kv_heads, num_blocks, block, dim, generator=gen) / 8
    k_scale, v_scale = 0.5, 2.0**-9  # stored magnitudes up to ~250: inside both formats' range
    stored_k = (keys / k_scale).to(fmt)
    stored_v = (values / v_scale).to(fmt)
    cache = torch.stack(
        [
            stored_k.transpose(2, 3).reshape(kv_heads, num_blocks, -1).view(torch.uint8),
            stored_v.reshape(kv_heads, num_blocks, -1).view(torch.uint8),
        ]
    ).view(fmt)
    lens = torch.randint(1, 6 * block, (n,), generator=gen)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:6] for _ in range(n)])
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)
    expected = []
    for i in range(n):
        k = stored_k[:, tables[i]].flatten(1, 2)[:, : lens[i]].double() * k_scale
        v = stored_v[:, tables[i]].flatten(1, 2)[:, : lens[i]].double() * v_scale
        expected.append(
            torch.nn.functional.scaled_dot_product_attention(q[i, :, None].double(), k, v, enable_gqa=True)[:, 0]
        )
    expected = torch.stack(expected)
    got = kernel(q, cache[0], cache[1], tables, lens, block, dim**-0.5, k_scale, v_scale)
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)
    attention = PagedAttention(heads, kv_heads, dim)
    attention.kv_scales = KVScales(k_scale, v_scale)
    padding = torch.arange(6 * block) >= lens.unsqueeze(1)
    mask = torch.zeros(padding.shape, dtype=dtype).masked_fill_(padding, float("-inf"))[None, :, None, :]
    torch_path = attention._decode(q, cache, DecodeGroup(0, tables, lens, mask), block)
    torch.testing.assert_close(torch_path.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_kernel_reads_every_finite_code_exactly(fmt):
    """A one-token context's output is its value row: each row here holds 16 of the format's byte codes."""
    kernel = paged_decode_attention_op()
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[codes.view(fmt).float().isfinite()]
    dim, block = 16, 16
    n = -(-len(codes) // dim)
    rows = torch.zeros(n * dim, dtype=torch.uint8)
    rows[: len(codes)] = codes
    values = torch.zeros(1, n, block * dim, dtype=torch.uint8)
    values[0, :, :dim] = rows.view(n, dim)
    out = kernel(
        torch.randn(n, 1, dim),
        torch.zeros_like(values).view(fmt),
        values.view(fmt),
        torch.arange(n).view(n, 1),
        torch.ones(n, dtype=torch.long),
        block,
        0.25,
        1.0,
        0.5,
    )
    assert torch.equal(out, rows.view(fmt).float().view(n, 1, dim) * 0.5)


# --- capacity, reports and settings -----------------------------------------------------------------------------


def test_the_same_budget_holds_4x_the_blocks_of_float32_and_2x_of_bfloat16(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    fp32_block = block_bytes(path, torch.float32)
    budget = dict(kv_cache_gib=50 * fp32_block / GIB, swap_space_gib=10 * fp32_block / GIB)
    full = LLM(str(path), skip_tokenizer_init=True, **budget).engine
    half = LLM(str(path), skip_tokenizer_init=True, dtype="bfloat16", **budget).engine
    assert (half.runner.num_blocks, half.runner.num_host_blocks) == (100, 20)
    bf16_fp8 = LLM(str(path), skip_tokenizer_init=True, dtype="bfloat16", kv_cache_dtype="fp8", **budget).engine
    assert (bf16_fp8.runner.num_blocks, bf16_fp8.runner.num_host_blocks) == (200, 40)
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        engine = LLM(str(path), skip_tokenizer_init=True, kv_cache_dtype=name, **budget).engine
        runner = engine.runner
        assert (full.runner.num_blocks, runner.num_blocks) == (50, 200)
        assert (full.runner.num_host_blocks, runner.num_host_blocks) == (10, 40)
        assert runner.kv_cache.element_size() == runner.host_cache.element_size() == 1
        assert runner.kv_cache.numel() == full.runner.kv_cache.numel() * 4
        assert engine.blocks.num_blocks == 200 and engine.limits.num_blocks == 200
        assert load_report(engine)["kv_cache_tokens"] == 200 * 16
    assert load_report(full)["kv_cache_tokens"] == 50 * 16


def test_the_fp8_alias_is_e4m3(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    fp8, e4m3 = fp8_llm(path, "fp8").engine.runner, fp8_llm(path, "fp8_e4m3").engine.runner
    assert fp8.kv_dtype == e4m3.kv_dtype == torch.float8_e4m3fn and fp8.kv_scales == e4m3.kv_scales


@pytest.mark.parametrize("bad", ["int8", "fp8_e4m3fn", "FP8", "float16", "", None])
def test_bad_kv_cache_dtype_fails_at_start_naming_the_setting(bad, tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype") as info:
        LLM(str(tmp_path / "never-loaded"), kv_cache_dtype=bad)
    assert "fp8_e5m2" in str(info.value), "the error lists the accepted values"


def test_the_flag_offers_the_choices(capsys):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--model", "m", "--kv-cache-dtype", "fp8_e5m2"])
    assert args.kv_cache_dtype == "fp8_e5m2"
    assert parser.parse_args(["--model", "m"]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--kv-cache-dtype", "int4"])
    assert "--kv-cache-dtype" in capsys.readouterr().err
    assert EngineConfig.from_options("m", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
