"""The engine in a process of its own (what the servers run): the same outputs as in this process, cancellation
frees blocks, bad requests and a dead engine process are errors, never hangs."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch
from fastapi.testclient import TestClient

from tests.checkpoints import SMALL_KV
from tokenfleet import LLM, SamplingParams
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.engine_process import EngineProcess, server_threads, start_engine
from tokenfleet.replica.server import create_app

PROMPTS = ["The list of", "Once upon a time there", "A B C D E F G", "import os\nimport"]


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    engine = EngineProcess(EngineConfig.from_options(str(demo_model_dir), **SMALL_KV))
    yield engine
    engine.shutdown()


async def stream(engine, prompt, params):
    return [out async for out in engine.generate(prompt, params)]


def test_same_tokens_text_and_logprobs_as_the_engine_in_this_process(engine, demo_model_dir):
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, stop=["e"]),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
    ]
    expected = LLM(str(demo_model_dir), **SMALL_KV).generate(PROMPTS, params)

    async def run_all():
        return await asyncio.gather(*(stream(engine, p, sp) for p, sp in zip(PROMPTS, params)))

    for outs, want in zip(asyncio.run(run_all()), expected):
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1])
        assert final.token_ids == want.token_ids == [t for o in outs for t in o.new_token_ids]
        assert final.text == want.text == "".join(o.new_text for o in outs)
        assert (final.finish_reason, final.stop_reason) == (want.finish_reason, want.stop_reason)
        assert final.prompt_token_ids == want.prompt_token_ids
        assert [lp.token_id for lp in final.logprobs] == [lp.token_id for lp in want.logprobs]
        assert final.engine_s > 0
    assert engine.state().load["running"] == 0


def test_leaving_a_stream_aborts_it_and_frees_its_blocks(engine):
    async def leave_early():
        seen = 0
        async for _ in engine.generate("The list of", SamplingParams(max_tokens=400, ignore_eos=True)):
            seen += 1
            if seen == 5:
                assert engine.state().load["kv_usage"] > 0
                break
        for _ in range(200):
            load = engine.state().load
            if load["running"] == 0 and load["kv_usage"] == 0:
                return load
            await asyncio.sleep(0.01)
        return load

    load = asyncio.run(leave_early())
    assert (load["running"], load["waiting"], load["kv_usage"]) == (0, 0, 0)


def test_bad_requests_raise_value_error_and_the_engine_goes_on(engine):
    with pytest.raises(ValueError, match="maximum context length"):
        engine.validate([5] * 10, SamplingParams(max_tokens=10**6))

    async def scenario():
        with pytest.raises(ValueError, match="empty"):
            await stream(engine, "", SamplingParams(max_tokens=4))
        return await stream(engine, "still serving", SamplingParams(max_tokens=4, ignore_eos=True))

    assert len(asyncio.run(scenario())[-1].token_ids) == 4


def test_a_dead_engine_process_fails_streams_instead_of_hanging(demo_model_dir):
    engine = EngineProcess(EngineConfig.from_options(str(demo_model_dir), **SMALL_KV))

    async def scenario():
        params = SamplingParams(max_tokens=2000, ignore_eos=True)
        outs = []
        with pytest.raises(RuntimeError, match="engine process exited"):
            async for out in engine.generate("The list of", params):
                outs.append(out)
                if len(outs) == 3:
                    os.kill(engine._process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="gone"):
            await stream(engine, "again", params)

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert engine.dead and "exit code" in engine.dead
    health = TestClient(create_app(engine, "tiny")).get("/health")
    assert health.status_code == 503 and health.json()["status"] == "engine down"
    engine.shutdown()


def test_a_bad_checkpoint_fails_the_start(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="failed to start"):
        EngineProcess(EngineConfig.from_options(str(tmp_path), skip_tokenizer_init=True, **SMALL_KV))


def test_thread_counts_and_the_in_process_choice(demo_model_dir):
    config = EngineConfig.from_options(str(demo_model_dir), **SMALL_KV)
    assert server_threads(config) == max(1, len(os.sched_getaffinity(0)) - 1)
    assert server_threads(EngineConfig.from_options(str(demo_model_dir), threads=3)) == 3
    before = torch.get_num_threads()
    threaded = start_engine(EngineConfig.from_options(str(demo_model_dir), engine_process=False, **SMALL_KV))
    try:
        assert type(threaded).__name__ == "AsyncEngine" and threaded.max_model_len == threaded.engine.max_model_len
        assert torch.get_num_threads() == server_threads(config)
    finally:
        threaded.shutdown()
        torch.set_num_threads(before)
