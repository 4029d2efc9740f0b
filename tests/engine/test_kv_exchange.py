"""Disaggregated prefill/decode inside the engine: one engine exports a prompt's KV blocks as its chunks are
computed, another imports them into its prefix cache and decodes from them exactly as if it had prefilled itself."""

from __future__ import annotations

import asyncio

import pytest

from tests.checkpoints import SMALL_KV, make_checkpoint
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.engine import Engine
from tokenfleet.engine.engine_process import EngineProcess
from tokenfleet.engine.kv_transfer import KVChunk
from tokenfleet.engine.request import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvx")
    return {arch: make_checkpoint(root / arch, arch) for arch in ("llama", "qwen3")}


def make_engine(path, **options) -> Engine:
    return Engine(EngineConfig.from_options(str(path), skip_tokenizer_init=True, **{**SMALL_KV, **options}))


def prompt(n: int, start: int = 11) -> list[int]:
    return [start + (i * 7) % 350 for i in range(n)]


def run(engine: Engine, token_ids: list[int], params: SamplingParams, request_id: str) -> list:
    engine.add_request(token_ids, params, request_id=request_id)
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def exported(engine: Engine, token_ids: list[int]) -> list[KVChunk]:
    outputs = run(engine, token_ids, SamplingParams(max_tokens=1, temperature=0.0, kv_export=True), "prefill")
    return [o.kv_chunk for o in outputs if o.kv_chunk is not None]


def assert_clean(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not any(engine.blocks.ref_counts)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_imported_blocks_decode_like_a_local_prefill(checkpoints, arch):
    path = checkpoints[arch]
    token_ids = prompt(150)
    alone = run(make_engine(path), token_ids, GREEDY, "alone")[-1].token_ids

    prefill = make_engine(path, max_num_batched_tokens=64)  # chunked: blocks leave after each chunk
    chunks = exported(prefill, token_ids)
    assert len(chunks) >= 2, "the prompt's blocks went out in one piece; chunked prefill should export per chunk"
    assert [c.first_block for c in chunks] == [0, *[c.end_block for c in chunks[:-1]]]
    assert chunks[-1].end_block == (len(token_ids) - 1) // 16
    assert_clean(prefill)

    decode = make_engine(path)
    held = [decode.kv_exchange.import_chunk(token_ids, c) for c in chunks]
    assert held == [c.end_block for c in chunks]
    assert_clean(decode)  # imported blocks belong to no request: they are free, cached prefixes
    outputs = run(decode, token_ids, GREEDY, "decode")
    assert outputs[-1].token_ids == alone
    assert outputs[-1].num_cached_tokens == chunks[-1].end_block * 16
    assert_clean(decode)


def test_import_skips_what_is_cached_and_checks_the_chunk(checkpoints):
    path = checkpoints["llama"]
    token_ids = prompt(100)
    chunks = exported(make_engine(path), token_ids)
    decode = make_engine(path)
    assert decode.kv_exchange.cached_prefix(token_ids) == 0
    first = decode.kv_exchange.import_chunk(token_ids, chunks[0])
    taken = sum(1 for c in decode.blocks.ref_counts if c == 0) - len(decode.blocks.free_plain)
    assert decode.kv_exchange.import_chunk(token_ids, chunks[0]) == first  # again: nothing new taken
    assert sum(1 for c in decode.blocks.ref_counts if c == 0) - len(decode.blocks.free_plain) == taken
    assert decode.kv_exchange.cached_prefix(token_ids) == first
    with pytest.raises(ValueError, match="bytes"):
        decode.kv_exchange.import_chunk(token_ids, KVChunk(0, 1, b"\0" * 10))
    with pytest.raises(ValueError, match="do not fit"):
        decode.kv_exchange.import_chunk(token_ids[:16], chunks[0])


def test_layouts_tell_checkpoints_and_block_sizes_apart(checkpoints, tmp_path):
    llama = make_engine(checkpoints["llama"]).kv_exchange.layout
    assert llama.mismatch(make_engine(checkpoints["llama"]).kv_exchange.layout) is None
    other_weights = make_checkpoint(tmp_path / "llama-seed1", "llama", seed=1)
    assert "model" in llama.mismatch(make_engine(other_weights).kv_exchange.layout)
    assert "block_size" in llama.mismatch(make_engine(checkpoints["llama"], block_size=32).kv_exchange.layout)
    assert llama.mismatch(make_engine(checkpoints["qwen3"]).kv_exchange.layout) is not None


def test_engines_that_cannot_move_blocks_say_why(checkpoints):
    engine = make_engine(checkpoints["llama"], enable_prefix_caching=False)
    assert engine.kv_exchange is None and "prefix caching" in engine.kv_transfer_refusal
    with pytest.raises(ValueError, match="cannot export"):
        engine.add_request(prompt(20), SamplingParams(max_tokens=1, kv_export=True))
    with pytest.raises(ValueError, match="prefix caching"):
        engine.exchange_call("cached_prefix", (prompt(20),))


@pytest.mark.parametrize("front", ["thread", "process"])
def test_exchange_calls_through_both_front_doors(checkpoints, front):
    path = checkpoints["llama"]
    token_ids = prompt(90)
    chunks = exported(make_engine(path), token_ids)
    config = EngineConfig.from_options(str(path), skip_tokenizer_init=True, **SMALL_KV)
    engine = AsyncEngine(config) if front == "thread" else EngineProcess(config)

    async def scenario() -> tuple[list[int], int, list[int]]:
        held = [await engine.exchange("import_chunk", token_ids, c) for c in chunks]
        cached = await engine.exchange("cached_prefix", token_ids)
        with pytest.raises(ValueError, match="unknown"):
            await engine.exchange("nonsense")
        tokens = []
        async for out in engine.generate(token_ids, GREEDY):
            tokens = out.token_ids
            cached_tokens = out.num_cached_tokens
        assert cached_tokens == cached * 16
        return held, cached, tokens

    try:
        held, cached, tokens = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert held[-1] == cached == (len(token_ids) - 1) // 16
    assert engine.kv_layout is not None and engine.kv_transfer_refusal is None
    assert tokens == run(make_engine(path), token_ids, GREEDY, "alone")[-1].token_ids
