"""One request whose sampling parameters break a step fails alone: its neighbours in the batch (other tenants'
requests) finish exactly as they would have without it, and the failed request's KV blocks are free at once."""

from __future__ import annotations

import pytest

from tests.checkpoints import SMALL_KV
from tests.engine.test_bad_input import assert_idle_and_clean, greedy, ids, run_to_completion
from tokenfleet import LLM, SamplingParams
from tokenfleet.engine.engine import Engine

NEIGHBOURS = {
    "greedy": (ids(20, start=100), greedy(8)),
    "seeded": (ids(35, start=400), SamplingParams(max_tokens=8, temperature=0.9, top_p=0.8, seed=7, ignore_eos=True)),
    "penalised": (
        ids(12, start=900),
        SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, logprobs=2, ignore_eos=True),
    ),
}


@pytest.fixture(scope="module")
def llm(demo_model_dir) -> LLM:
    return LLM(str(demo_model_dir), max_model_len=256, **SMALL_KV)


@pytest.fixture
def engine(llm) -> Engine:
    assert_idle_and_clean(llm.engine)
    yield llm.engine
    assert_idle_and_clean(llm.engine)


def alone(llm: LLM) -> dict[str, list[int]]:
    return {
        name: llm.generate({"prompt_token_ids": prompt}, params)[0].token_ids
        for name, (prompt, params) in NEIGHBOURS.items()
    }


def add_neighbours(engine: Engine) -> None:
    for name, (prompt, params) in NEIGHBOURS.items():
        engine.add_request(prompt, params, request_id=name)


def assert_neighbours_unharmed(done: dict, expected: dict[str, list[int]]) -> None:
    for name, tokens in expected.items():
        assert done[name].finish_reason == "length" and done[name].error is None, done[name].error
        assert done[name].token_ids == tokens, f"{name} differs from its output alone"


@pytest.mark.parametrize("top_p", [1e-50, 1e-320, 5e-324])
def test_a_vanishing_top_p_keeps_the_most_likely_token(llm, top_p):
    """top_p rounds to 0 in the logits' float32: the nucleus is still the top token, i.e. greedy decoding."""
    prompt = ids(16, start=50)
    expected = llm.generate({"prompt_token_ids": prompt}, greedy(8))[0].token_ids
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, top_p=top_p, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.error is None, out.error
    assert out.token_ids == expected


def test_any_integer_seed_is_usable(llm):
    """torch's generators take seeds in [-2**63, 2**64): the engine wraps any other int the same way instead of
    failing the request (the API refuses them, but a request's second choice gets seed + 1)."""

    def sample(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": ids(10, start=80)}, params)[0]
        assert out.finish_reason == "length" and out.error is None, out.error
        return out.token_ids

    assert sample(2**64 + 5) == sample(5)
    assert sample(-(2**63) - 1) == sample(2**63 - 1)


def test_a_tiny_top_p_beside_other_requests(llm, engine):
    expected = alone(llm)
    add_neighbours(engine)
    engine.add_request(ids(9, start=60), SamplingParams(max_tokens=5, top_p=1e-50, ignore_eos=True), request_id="p")
    done = run_to_completion(engine)
    assert done["p"].finish_reason == "length" and len(done["p"].token_ids) == 5
    assert_neighbours_unharmed(done, expected)


def test_a_request_that_breaks_sampling_fails_alone(llm, engine):
    """top_k=2.5 passes SamplingParams' checks (it is >= 0) but breaks torch.topk: only that request fails."""
    expected = alone(llm)
    add_neighbours(engine)
    engine.step()  # the neighbours are running (prefilled) when the bad one joins their batch
    poisoned = engine.add_request(
        ids(30, start=700), SamplingParams(max_tokens=8, top_k=2.5, ignore_eos=True), request_id="poisoned"
    )
    outputs = {out.request_id: out for out in engine.step()}
    failed = outputs["poisoned"]
    assert failed.finished and failed.finish_reason == "error"
    assert "sampling failed" in failed.error and "topk" in failed.error
    assert poisoned.block_table == [] and "poisoned" not in engine.tracked  # its blocks are free already
    assert not any(outputs[name].finished for name in NEIGHBOURS)
    done = run_to_completion(engine)
    assert_neighbours_unharmed(done, expected)


def test_a_request_whose_new_token_cannot_be_processed_fails_alone(llm, engine):
    """A failure after sampling (stop checks, detokenizing) is the request's alone, like one in sampling."""
    expected = alone(llm)
    add_neighbours(engine)
    broken = engine.add_request(ids(30, start=700), greedy(8), request_id="broken")
    broken.params.stop_token_ids = None  # what no validation lets in: `token in None` raises at its first token
    done = run_to_completion(engine)
    assert done["broken"].finish_reason == "error" and "processing the new token failed" in done["broken"].error
    assert_neighbours_unharmed(done, expected)
