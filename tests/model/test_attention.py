"""The CPU paged decode kernel computes what the PyTorch gather path computes, on the same paged cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.checkpoints import SMALL_KV, load_reference, make_checkpoint, reference_greedy
from tokenfleet import LLM, SamplingParams
from tokenfleet.model.attention import DecodeGroup, PagedAttention
from tokenfleet.model.cpu_kernels import paged_decode_attention_op

BLOCK = 16


@pytest.fixture(scope="module")
def kernel():
    op = paged_decode_attention_op()
    assert op is not None, "the CPU kernel failed to build on this machine (see the log warning)"
    return op


def random_paged_batch(n: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int = 0):
    """Logical keys/values [KVH, blocks, BLOCK, D], their cache layout, and random block tables."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    keys = torch.randn(kv_heads, num_blocks, BLOCK, dim, generator=gen).to(dtype)
    values = torch.randn(kv_heads, num_blocks, BLOCK, dim, generator=gen).to(dtype)
    lens = torch.randint(1, 8 * BLOCK, (n,), generator=gen)
    width = int(-(-lens.max() // BLOCK))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(n)])
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)
    return q, keys, values, tables, lens


def cache_layout(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[2, KVH, blocks, BLOCK * D]: keys transposed inside each block, values as they are."""
    kvh, blocks = keys.shape[:2]
    return torch.stack([keys.transpose(2, 3).reshape(kvh, blocks, -1), values.reshape(kvh, blocks, -1)])


def reference(q, keys, values, tables, lens):
    """Plain attention over each sequence's gathered context, in float64."""
    out = []
    for i in range(q.shape[0]):
        n = int(lens[i])
        k = keys[:, tables[i]].flatten(1, 2)[:, :n].double()
        v = values[:, tables[i]].flatten(1, 2)[:, :n].double()
        out.append(F.scaled_dot_product_attention(q[i, :, None].double(), k, v, enable_gqa=True)[:, 0])
    return torch.stack(out)


def torch_path(q, cache, tables, lens):
    heads, kv_heads, dim = q.shape[1], cache.shape[1], q.shape[2]
    padding = torch.arange(tables.shape[1] * BLOCK) >= lens.unsqueeze(1)
    mask = torch.zeros(padding.shape, dtype=q.dtype).masked_fill_(padding, float("-inf"))[None, :, None, :]
    return PagedAttention(heads, kv_heads, dim)._decode(q, cache, DecodeGroup(0, tables, lens, mask), BLOCK)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (8, 8, 64), (6, 1, 32)])
def test_kernel_and_torch_path_match_plain_attention(kernel, dtype, tol, heads, kv_heads, dim):
    q, keys, values, tables, lens = random_paged_batch(9, heads, kv_heads, dim, dtype)
    cache = cache_layout(keys, values)
    expected = reference(q, keys, values, tables, lens)
    got = kernel(q, cache[0], cache[1], tables, lens, BLOCK, dim**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(torch_path(q, cache, tables, lens).double(), expected, atol=tol, rtol=tol)


def test_kernel_uses_only_the_context(kernel):
    """Positions past a sequence's length, and blocks outside its table, must not change its output."""
    q, keys, values, tables, lens = random_paged_batch(3, 4, 2, 16, torch.float32, seed=1)
    before = kernel(q, *cache_layout(keys, values), tables, lens, BLOCK, 0.25)
    used = torch.zeros(keys.shape[1], BLOCK, dtype=torch.bool)
    for i in range(3):
        for t in range(int(lens[i])):
            used[tables[i, t // BLOCK], t % BLOCK] = True
    keys[:, ~used] = 1e4
    values[:, ~used] = -1e4
    torch.testing.assert_close(kernel(q, *cache_layout(keys, values), tables, lens, BLOCK, 0.25), before)


def test_engine_without_kernel_matches_reference(tmp_path):
    path = make_checkpoint(tmp_path, "qwen2")
    reference = load_reference(path)
    llm = LLM(str(path), skip_tokenizer_init=True, max_num_batched_tokens=40, **SMALL_KV)
    llm.engine.runner.use_decode_kernel(None)
    prompts = [[(7 * i + j) % 380 + 3 for j in range(10 + 13 * i)] for i in range(5)]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == reference_greedy(reference, prompt, 10)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-3)])
def test_the_fused_silu_and_mul_matches_pytorch(kernel, dtype, tol):
    """The MLP's activation in the same library: one pass over [gate | up], large magnitudes included."""
    x = (torch.randn(37, 2 * 96, generator=torch.Generator().manual_seed(1)) * 8).to(dtype)
    x[0, 0], x[1, 1] = -200.0, 200.0  # exp overflows unclamped
    gate, up = x.float().chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = torch.ops.tokenfleet.silu_and_mul(x)
    assert got.dtype == dtype and got.shape == (37, 96) and torch.isfinite(got).all()
    assert torch.allclose(got.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    strided = torch.ops.tokenfleet.silu_and_mul(torch.cat([x, x], dim=-1)[:, : 2 * 96])  # rows apart in memory
    assert torch.equal(strided, got)


def test_the_engine_uses_the_fused_activation_only_with_the_kernel(tmp_path, kernel):
    llm = LLM(str(make_checkpoint(tmp_path, "llama")), skip_tokenizer_init=True, **SMALL_KV)
    runner = llm.engine.runner
    runner.use_decode_kernel(kernel)
    assert all(layer.mlp.silu_and_mul is not None for layer in runner.model.layers)
    runner.use_decode_kernel(None)
    assert all(layer.mlp.silu_and_mul is None for layer in runner.model.layers)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 0.0), (torch.float16, 1e-3)])
def test_the_one_pass_rms_norm_matches_the_module(kernel, dtype, tol):
    """RMSNorm through the CPU library: the module's roundings (normalized in float, rounded to the dtype, then times
    the weight), large and tiny rows included, and rows apart in memory."""
    from tokenfleet.model.llama import RMSNorm

    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(192, 1e-6).to(dtype)
    norm.weight.data = torch.randn(192, generator=gen).to(dtype)
    x = (torch.randn(41, 192, generator=gen) * 3).to(dtype)
    x[0] *= 1000
    x[1] *= 1e-3
    expected = norm(x)
    got = torch.ops.tokenfleet.rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=tol or 1e-2, rtol=tol or 1e-2)
    if dtype == torch.bfloat16:  # one rounding apart at most, as the module's own float path is
        assert (got.float() - expected.float()).abs().max() <= expected.float().abs().max() * 2**-7
    wide = torch.cat([x, x], dim=-1)[:, :192]  # rows apart in memory
    assert torch.equal(torch.ops.tokenfleet.rms_norm(wide, norm.weight, norm.eps), got)
    norm.fused = torch.ops.tokenfleet.rms_norm
    assert torch.equal(norm(x), got)


def test_the_engine_uses_the_one_pass_norm_only_with_the_kernel(tmp_path, kernel):
    from tokenfleet.model.llama import RMSNorm

    llm = LLM(str(make_checkpoint(tmp_path, "llama")), skip_tokenizer_init=True, **SMALL_KV)
    runner = llm.engine.runner
    norms = [m for m in runner.model.modules() if isinstance(m, RMSNorm)]
    runner.use_decode_kernel(kernel)
    assert norms and all(n.fused is not None for n in norms)
    runner.use_decode_kernel(None)
    assert all(n.fused is None for n in norms)
