"""The engine's two front doors: cancellation in every state, the async stream, sampling through real steps."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.checkpoints import SMALL_KV, make_checkpoint
from tokenfleet import LLM, SamplingParams
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.engine import Engine
from tokenfleet.engine.request import RequestStatus


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def ids(n: int, start: int = 10) -> list[int]:
    return [start + i % 300 for i in range(n)]


def idle_and_clean(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert len(engine.blocks.free_host) == engine.runner.num_host_blocks


def make_engine(path, **options) -> Engine:
    return Engine(EngineConfig.from_options(str(path), skip_tokenizer_init=True, **{**SMALL_KV, **options}))


def test_abort_in_every_state(llama_dir):
    engine = make_engine(llama_dir, max_num_batched_tokens=32, max_num_seqs=2, swap_threshold_tokens=16)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    decoding = engine.add_request(ids(20), params, request_id="decoding", priority=3)
    engine.step()
    engine.step()
    assert decoding.status is RequestStatus.RUNNING and decoding.num_output_tokens >= 1
    prefilling = engine.add_request(ids(100, 50), params, request_id="prefilling")
    engine.step()
    assert prefilling.status is RequestStatus.RUNNING and 0 < prefilling.num_computed_tokens < 100
    waiting = engine.add_request(ids(10, 90), params, request_id="waiting", priority=5)
    engine.step()
    assert waiting.status is RequestStatus.WAITING  # both sequence slots are taken
    for request_id in ("prefilling", "waiting"):
        assert engine.abort(request_id)
    while decoding.num_computed_tokens < 40:
        engine.step()
    filler = engine.add_request(ids(30, 7), SamplingParams(max_tokens=30, temperature=0.0), priority=0)
    engine.step()
    # a more important request finds no free slot: the long, less important decode is swapped out for it
    urgent = engine.add_request(ids(50, 9), SamplingParams(max_tokens=4, temperature=0.0), priority=0)
    engine.step()
    assert decoding.status is RequestStatus.SWAPPED, decoding.status
    assert urgent.status is RequestStatus.RUNNING and filler.num_preemptions == 0
    assert engine.abort("decoding")
    assert not engine.abort("decoding"), "aborting twice reports the request unknown"
    while engine.has_unfinished():
        engine.step()
    assert urgent.finish_reason == "length"
    assert [r.finish_reason for r in (decoding, prefilling, waiting)] == ["abort"] * 3
    idle_and_clean(engine)


def test_seeded_sampling_same_alone_and_in_batch(llama_dir):
    llm = LLM(str(llama_dir), skip_tokenizer_init=True, max_num_batched_tokens=64, **SMALL_KV)
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": ids(30)}, seeded)[0].token_ids
    others = [
        SamplingParams(max_tokens=25, temperature=1.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.7, seed=7, ignore_eos=True),
    ]
    batch = llm.generate(
        [{"prompt_token_ids": ids(n, s)} for n, s in ((50, 3), (70, 4), (30, 10), (90, 5))],
        [others[0], others[1], seeded, others[2]],
    )
    assert batch[2].token_ids == alone
    again = llm.generate({"prompt_token_ids": ids(30)}, SamplingParams(**{**seeded.__dict__, "seed": 99}))[0]
    assert again.token_ids != alone


def test_stop_token_ids_min_tokens_and_logprobs(llama_dir):
    llm = LLM(str(llama_dir), skip_tokenizer_init=True, **SMALL_KV)
    free = llm.generate({"prompt_token_ids": ids(12)}, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[
        0
    ].token_ids
    stop_at = free[5]
    first = free.index(stop_at)
    out = llm.generate(
        {"prompt_token_ids": ids(12)},
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True),
    )[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    delayed = llm.generate(
        {"prompt_token_ids": ids(12)},
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[free[0]], min_tokens=3, ignore_eos=True),
    )[0]
    assert len(delayed.token_ids) >= 3 and free[0] not in delayed.token_ids[:3]
    with_lp = llm.generate(
        {"prompt_token_ids": ids(12)}, SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    )[0]
    assert len(with_lp.logprobs) == 4
    for token, lp in zip(with_lp.token_ids, with_lp.logprobs):
        assert lp.token_id == token and len(lp.top) == 3 and lp.top[0][0] == token  # greedy = most likely
        assert lp.logprob <= 0.0


def test_stop_strings_and_text(demo_model_dir):
    llm = LLM(str(demo_model_dir), **SMALL_KV)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = llm.generate("The list of", greedy)[0]
    assert full.text == llm.tokenizer.decode(full.token_ids)
    cut = full.text[3:7]
    stopped = llm.generate("The list of", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[cut]))[
        0
    ]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == cut
    assert stopped.text == full.text[: full.text.index(cut)]


def test_detokenize_off_gives_the_same_tokens_without_text(demo_model_dir):
    llm = LLM(str(demo_model_dir), **SMALL_KV)
    with_text, ids_only = llm.generate(
        ["The list of"] * 2,
        [
            SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, detokenize=False),
        ],
    )
    assert ids_only.token_ids == with_text.token_ids and with_text.text and ids_only.text == ""
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_async_engine_streams_and_cancels(llama_dir):
    engine = AsyncEngine(EngineConfig.from_options(str(llama_dir), skip_tokenizer_init=True, **SMALL_KV))

    async def scenario():
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        stream = [o async for o in engine.generate(ids(20), params, request_id="full")]
        assert [len(o.new_token_ids) for o in stream] == [1] * 16
        assert stream[-1].finished and stream[-1].token_ids == [t for o in stream for t in o.new_token_ids]

        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        seen = 0
        async for _ in engine.generate(ids(20), long, request_id="leaver"):
            seen += 1
            if seen == 3:
                break  # the consumer goes away: the request is aborted
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate([], params):
                pass
        together = await asyncio.gather(*(collect(engine, ids(10 + i), params) for i in range(4)))
        assert all(len(t) == 16 for t in together)

    asyncio.run(scenario())
    for _ in range(100):
        if not engine.engine.has_unfinished():
            break
        asyncio.run(asyncio.sleep(0.02))
    engine.shutdown()
    idle_and_clean(engine.engine)


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    final = None
    async for out in engine.generate(prompt, params):
        final = out
    return final.token_ids


def test_step_stats_account_for_the_step(llama_dir):
    llm = LLM(str(llama_dir), skip_tokenizer_init=True, **SMALL_KV)
    llm.generate([{"prompt_token_ids": ids(40)}] * 3, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    stats = llm.engine.stats
    assert stats.steps >= 5
    parts = [stats.schedule_s, stats.prepare_s, stats.forward_s, stats.sample_s, stats.output_s]
    assert all(p >= 0 for p in parts) and stats.forward_s > 0
    assert 0 < stats.overhead_fraction() < 1


def test_each_request_gets_its_share_of_step_time_by_tokens_computed(llama_dir):
    engine = make_engine(llama_dir)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request(ids(200), params, "long")
    engine.add_request(ids(10, start=5), params, "short")
    finals, busy = {}, 0.0
    while engine.has_unfinished():
        started = time.perf_counter()
        outputs = engine.step()
        busy += time.perf_counter() - started
        finals.update({o.request_id: o for o in outputs if o.finished})
    shares = {rid: out.engine_s for rid, out in finals.items()}
    assert sum(shares.values()) == pytest.approx(busy, rel=0.1)  # the steps' time, nothing more or less
    assert shares["long"] > shares["short"] > 0  # prefilled 200 tokens against 10, then decoded alike
