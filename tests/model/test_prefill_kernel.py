"""The CPU prefill kernel: every chunk of a step attends causally, straight over the paged cache, and computes
what plain attention over each position's prefix computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.checkpoints import SMALL_KV, load_reference, make_checkpoint, reference_greedy
from tokenfleet import LLM, SamplingParams
from tokenfleet.model.attention import PagedAttention
from tokenfleet.model.cpu_kernels import paged_decode_attention_op
from tokenfleet.model.kv_quant import quantize

# (context before the chunk, chunk length): a fresh prompt, a chunk after a cached prefix that ends mid-block, a
# one-token chunk, a chunk spanning several blocks after a whole-block prefix
CHUNKS = [(0, 37), (21, 18), (50, 1), (32, 45)]


@pytest.fixture(scope="module")
def library():
    assert paged_decode_attention_op() is not None, "the CPU kernel failed to build on this machine"
    return torch.ops.tokenfleet.paged_prefill_attention


def paged(kv_heads: int, dim: int, block: int, dtype: torch.dtype, seed: int):
    """Logical keys/values [KVH, blocks, block, D] and one random table per chunk (no block in two tables)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 48
    keys = torch.randn(kv_heads, num_blocks, block, dim, generator=gen).to(dtype)
    values = torch.randn(kv_heads, num_blocks, block, dim, generator=gen).to(dtype)
    width = max(-(-(start + n) // block) for start, n in CHUNKS)
    tables = torch.randperm(num_blocks, generator=gen)[: width * len(CHUNKS)].view(len(CHUNKS), width)
    return keys, values, tables


def layout(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    kvh, blocks = keys.shape[:2]
    return torch.stack([keys.transpose(2, 3).reshape(kvh, blocks, -1), values.reshape(kvh, blocks, -1)])


def reference(q, keys, values, tables, scale):
    """Each chunk row attends to its sequence's tokens 0..its position, in float64."""
    out, row = [], 0
    for (start, n), table in zip(CHUNKS, tables):
        k = keys[:, table].flatten(1, 2).double()
        v = values[:, table].flatten(1, 2).double()
        for i in range(n):
            context = start + i + 1
            qi = q[row + i, :, None].double()
            out.append(F.scaled_dot_product_attention(qi, k[:, :context], v[:, :context], scale=scale, enable_gqa=True))
        row += n
    return torch.stack(out)[:, :, 0]


def run(library, q, cache, tables, block, scale, k_scale=1.0, v_scale=1.0):
    lens = torch.tensor([n for _, n in CHUNKS])
    starts = torch.tensor([start for start, _ in CHUNKS])
    return library(q, cache[0], cache[1], tables, lens, starts, block, scale, k_scale, v_scale)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 32), (4, 2, 16), (8, 8, 64), (6, 1, 32), (4, 4, 128)])
def test_the_prefill_kernel_matches_plain_causal_attention(library, dtype, tol, heads, kv_heads, dim):
    keys, values, tables = paged(kv_heads, dim, 16, dtype, seed=heads + dim)
    rows = sum(n for _, n in CHUNKS)
    q = torch.randn(rows, heads, dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = run(library, q, layout(keys, values), tables, 16, dim**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), reference(q, keys, values, tables, dim**-0.5), atol=tol, rtol=tol)


@pytest.mark.parametrize("block", [8, 32])
def test_other_block_sizes(library, block):
    keys, values, tables = paged(2, 32, block, torch.float32, seed=block)
    q = torch.randn(sum(n for _, n in CHUNKS), 6, 32, generator=torch.Generator().manual_seed(4))
    got = run(library, q, layout(keys, values), tables, block, 32**-0.5)
    torch.testing.assert_close(got.double(), reference(q, keys, values, tables, 32**-0.5), atol=1e-5, rtol=1e-5)


def test_a_position_never_sees_a_later_token(library):
    """Keys and values past each row's position, and outside the tables, must not change its output."""
    keys, values, tables = paged(2, 32, 16, torch.float32, seed=7)
    q = torch.randn(sum(n for _, n in CHUNKS), 6, 32, generator=torch.Generator().manual_seed(5))
    before = run(library, q, layout(keys, values), tables, 16, 0.2)
    row = 0
    for (start, n), table in zip(CHUNKS, tables):
        flat_k = keys[:, table].flatten(1, 2)
        flat_k[:, start + n :] = 1e4  # beyond the chunk's last position
        keys[:, table] = flat_k.view(keys[:, table].shape)
        row += n
    rest = torch.ones(keys.shape[1], dtype=torch.bool)
    rest[tables.flatten()] = False
    values[:, rest] = -1e4
    torch.testing.assert_close(run(library, q, layout(keys, values), tables, 16, 0.2), before)
    # and within a chunk: a row's output depends on no later row's key
    first_chunk = before[: CHUNKS[0][1]]
    keys[:, tables[0]] = (
        keys[:, tables[0]].flatten(1, 2).index_fill(1, torch.tensor([20]), 50.0).view_as(keys[:, tables[0]])
    )
    after = run(library, q, layout(keys, values), tables, 16, 0.2)[: CHUNKS[0][1]]
    torch.testing.assert_close(after[:20], first_chunk[:20])
    assert not torch.allclose(after[20:], first_chunk[20:])


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_cache_is_read_dequantized(library, fmt):
    keys, values, tables = paged(2, 32, 16, torch.float32, seed=11)
    k_scale, v_scale = 0.02, 0.03
    stored_k, stored_v = quantize(keys, k_scale, fmt), quantize(values, v_scale, fmt)
    seen_k, seen_v = stored_k.float() * k_scale, stored_v.float() * v_scale
    q = torch.randn(sum(n for _, n in CHUNKS), 6, 32, generator=torch.Generator().manual_seed(6))
    got = run(library, q, layout(stored_k, stored_v), tables, 16, 32**-0.5, k_scale, v_scale)
    torch.testing.assert_close(got.double(), reference(q, seen_k, seen_v, tables, 32**-0.5), atol=1e-4, rtol=1e-4)


def test_mismatched_lengths_are_refused(library):
    keys, values, tables = paged(2, 32, 16, torch.float32, seed=1)
    cache = layout(keys, values)
    q = torch.randn(10, 6, 32)
    with pytest.raises(RuntimeError, match="add up"):
        run(library, q, cache, tables, 16, 0.2)
    lens, starts = torch.tensor([n for _, n in CHUNKS]), torch.tensor([10_000, 0, 0, 0])
    q = torch.randn(int(lens.sum()), 6, 32)
    with pytest.raises(RuntimeError, match="past its block table"):
        library(q, cache[0], cache[1], tables, lens, starts, 16, 0.2, 1.0, 1.0)


def test_the_engine_prefills_through_the_kernel_and_matches_the_reference(tmp_path, monkeypatch):
    """Chunked prefill (a 24-token budget splits prompts) and prefix hits (repeated prompts) go through one kernel
    call per layer, never the per-chunk PyTorch path, and greedy outputs match the Hugging Face model's."""
    path = make_checkpoint(tmp_path, "llama")
    reference_model = load_reference(path)
    llm = LLM(str(path), skip_tokenizer_init=True, max_num_batched_tokens=24, **SMALL_KV)
    assert llm.engine.runner.decode_kernel is not None

    def per_chunk_path(*args, **kwargs):
        raise AssertionError("a prefill chunk took the per-chunk PyTorch path while the kernel is loaded")

    monkeypatch.setattr(PagedAttention, "_prefill", per_chunk_path)
    calls = []
    original = PagedAttention._prefill_batch
    monkeypatch.setattr(PagedAttention, "_prefill_batch", lambda self, *a: calls.append(1) or original(self, *a))
    prompts = [[(5 * i + j) % 300 + 3 for j in range(9 + 11 * i)] for i in range(4)]
    prompts += prompts[:2]  # found in the prefix cache the second time
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    assert calls, "no step prefilled through the kernel"
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == reference_greedy(reference_model, prompt, 8)
