"""Bad requests are rejected up front with a ValueError naming the problem, and never hurt the engine: requests around
them complete, nothing stays queued, no KV block leaks. A model step that raises fails only its own requests."""

from __future__ import annotations

import pytest

from tests.checkpoints import SMALL_KV
from tokenfleet import LLM, SamplingParams
from tokenfleet.engine.engine import Engine

MAX_LEN = 256
BLOCK_BYTES = 16 * 2 * 2 * 2 * 16 * 4  # demo "tiny": 16 tokens x K,V x 2 layers x 2 KV heads x 16 dims x fp32
VOCAB = 4096


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def make_llm(model_dir, num_blocks: int = 64, **kw) -> LLM:
    return LLM(
        str(model_dir),
        max_model_len=MAX_LEN,
        kv_cache_gib=num_blocks * BLOCK_BYTES / (1 << 30),
        swap_space_gib=SMALL_KV["swap_space_gib"],
        **kw,
    )


@pytest.fixture(scope="module")
def llm(demo_model_dir) -> LLM:
    return make_llm(demo_model_dir)


@pytest.fixture
def engine(llm) -> Engine:
    assert_idle_and_clean(llm.engine)
    yield llm.engine
    assert_idle_and_clean(llm.engine)


def assert_idle_and_clean(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert not engine.tracked
    assert not engine.scheduler.running and not engine.scheduler.queue
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, "a KV block leaked"
    assert not any(engine.blocks.ref_counts)


def run_to_completion(engine: Engine) -> dict:
    finished = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return finished
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, "a request finished twice"
                finished[out.request_id] = out
    raise AssertionError("the engine never went idle")


def ids(n: int, start: int = 10) -> list[int]:
    return [start + i % 500 for i in range(n)]


def mutated(**fields) -> SamplingParams:
    """Valid when built, then changed: the engine must check the values it is given, not trust construction."""
    params = greedy()
    for name, value in fields.items():
        setattr(params, name, value)
    return params


# (prompt, params, words the message must contain)
BAD_REQUESTS = {
    "empty text": ("", None, ["empty"]),
    "empty ids": ([], None, ["empty"]),
    "prompt fills the window": (ids(MAX_LEN), greedy(1), ["256 tokens", "maximum context length is 256"]),
    "prompt past the window": (ids(300), greedy(1), ["300 tokens", "maximum context length is 256"]),
    "long text": ("hello world " * 400, greedy(1), ["maximum context length is 256"]),
    "max_tokens past the window": (
        ids(10),
        greedy(247),
        ["maximum context length is 256", "257 tokens", "247 to generate"],
    ),
    "max_tokens far past the window": (ids(200), greedy(10_000), ["maximum context length", "10200"]),
    "token id = vocab size": ([5, 6, VOCAB], None, [f"{VOCAB}", "outside the vocabulary"]),
    "token id huge": ([5, 10**12], None, [f"{10**12}", "outside the vocabulary"]),
    "negative token id": ([5, -1, 6], None, ["-1", "outside the vocabulary"]),
    "float token id": ([5, 1.5], None, ["integer token ids"]),
    "string token id": ([5, "6"], None, ["integer token ids"]),
    "not a prompt": (7, None, ["integer token ids"]),
    "max_tokens 0 (mutated)": (ids(5), mutated(max_tokens=0), ["max_tokens", "0"]),
    "max_tokens -3 (mutated)": (ids(5), mutated(max_tokens=-3), ["max_tokens", "-3"]),
    "temperature < 0 (mutated)": (ids(5), mutated(temperature=-0.5), ["temperature", "-0.5"]),
    "top_p 0 (mutated)": (ids(5), mutated(top_p=0.0), ["top_p", "0.0"]),
    "top_p > 1 (mutated)": (ids(5), mutated(top_p=1.5), ["top_p", "1.5"]),
    "logprobs -1 (mutated)": (ids(5), mutated(logprobs=-1), ["logprobs", "-1"]),
    "logprobs 21 (mutated)": (ids(5), mutated(logprobs=21), ["logprobs", "21"]),
}

BAD_PARAMS = {
    "max_tokens 0": (dict(max_tokens=0), ["max_tokens", "at least 1", "0"]),
    "max_tokens negative": (dict(max_tokens=-5), ["max_tokens", "-5"]),
    "temperature < 0": (dict(temperature=-0.1), ["temperature", "-0.1"]),
    "top_p 0": (dict(top_p=0.0), ["top_p", "(0, 1]"]),
    "top_p > 1": (dict(top_p=1.01), ["top_p", "1.01"]),
    "top_p negative": (dict(top_p=-0.5), ["top_p"]),
    "logprobs negative": (dict(logprobs=-1), ["logprobs", "-1"]),
    "logprobs too many": (dict(logprobs=21), ["logprobs", "21"]),
    "min_tokens > max_tokens": (dict(min_tokens=9, max_tokens=3), ["min_tokens", "max_tokens"]),
}


@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_bad_sampling_params_rejected(case):
    fields, words = BAD_PARAMS[case]
    with pytest.raises(ValueError) as info:
        SamplingParams(**fields)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


def test_bad_requests_rejected_and_engine_keeps_serving(engine, llm):
    prompt_a, prompt_b = ids(20, start=100), ids(37, start=900)
    engine.add_request(prompt_a, greedy(), request_id="before-a")
    engine.add_request(prompt_b, greedy(), request_id="before-b")
    engine.step()  # both are running (prefilled) while the bad ones arrive
    assert {r.request_id for r in engine.scheduler.running} == {"before-a", "before-b"}
    used = engine.blocks.num_blocks - engine.blocks.num_free_blocks

    for case, (prompt, params, words) in BAD_REQUESTS.items():
        with pytest.raises(ValueError) as info:
            engine.add_request(prompt, params, request_id=f"bad-{case}")
        for word in words:
            assert word in str(info.value), f"{case}: {word!r} not in {info.value}"
        assert f"bad-{case}" not in engine.tracked, case
        assert len(engine.scheduler.queue) == 0 and len(engine.scheduler.running) == 2, case
        assert engine.blocks.num_blocks - engine.blocks.num_free_blocks == used, case

    with pytest.raises(ValueError, match="request id 'before-a' is already in use"):
        engine.add_request(ids(4), greedy(), request_id="before-a")
    engine.add_request(ids(12, start=300), greedy(), request_id="dup")
    with pytest.raises(ValueError, match="request id 'dup' is already in use"):
        engine.add_request(ids(4), greedy(), request_id="dup")
    engine.add_request(ids(9, start=40), greedy(5), request_id="after")

    done = run_to_completion(engine)
    assert set(done) == {"before-a", "before-b", "dup", "after"}
    for out in done.values():
        assert out.finish_reason == "length" and out.error is None
    assert len(done["after"].token_ids) == 5
    assert done["dup"].prompt_token_ids == ids(12, start=300)  # the rejected duplicate did not replace it
    # the survivors computed what they compute alone
    alone = llm.generate([{"prompt_token_ids": prompt_a}, {"prompt_token_ids": prompt_b}], greedy())
    assert done["before-a"].token_ids == alone[0].token_ids
    assert done["before-b"].token_ids == alone[1].token_ids
    # a finished request's id can be used again
    engine.add_request(ids(3), greedy(2), request_id="dup")
    assert len(run_to_completion(engine)["dup"].token_ids) == 2


def test_boundaries_are_accepted(engine):
    """The largest valid requests are not rejected: prompt + max_tokens == max_model_len, and the default max_tokens."""
    engine.add_request(ids(250), greedy(6), request_id="exact")
    engine.add_request(ids(MAX_LEN - 1), greedy(1), request_id="one-left")
    engine.add_request(ids(240), SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True), request_id="auto")
    engine.add_request([0, VOCAB - 1], greedy(2), request_id="vocab-edges")
    done = run_to_completion(engine)
    assert len(done["exact"].token_ids) == 6
    assert len(done["one-left"].token_ids) == 1
    assert len(done["auto"].token_ids) == MAX_LEN - 240
    assert all(o.finish_reason == "length" for o in done.values())


def test_caller_cannot_change_params_of_a_queued_request(engine):
    params = greedy(4)
    engine.add_request(ids(8), params, request_id="mine")
    params.max_tokens, params.top_p = 0, 0.0  # changing the caller's object afterwards changes nothing queued
    done = run_to_completion(engine)
    assert len(done["mine"].token_ids) == 4 and done["mine"].error is None


def test_request_larger_than_the_kv_cache(demo_model_dir):
    small = make_llm(demo_model_dir, num_blocks=8, skip_tokenizer_init=True)
    engine = small.engine
    with pytest.raises(ValueError, match=r"needs 13 KV cache blocks, but the cache holds 7"):
        engine.add_request(ids(100), greedy(100))
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        engine.add_request("hello", greedy())
    out = small.generate({"prompt_token_ids": ids(60)}, greedy(40))[0]  # 100 tokens = 7 blocks: fits
    assert len(out.token_ids) == 40
    assert_idle_and_clean(engine)


# --- LLM.generate: all or nothing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_at", [0, 2, 4])
def test_generate_with_one_bad_prompt_queues_nothing(llm, bad_at):
    good = [
        "Hello there",
        {"prompt_token_ids": ids(30)},
        "The quick brown fox",
        {"prompt_token_ids": ids(5)},
        "jumps over",
    ]
    prompts = list(good)
    prompts[bad_at] = {"prompt_token_ids": ids(MAX_LEN + 10)}
    with pytest.raises(ValueError, match="maximum context length is 256"):
        llm.generate(prompts, greedy(4))
    assert not llm.engine.has_unfinished()
    assert_idle_and_clean(llm.engine)

    outputs = llm.generate(good, greedy(4))
    assert [len(o.token_ids) for o in outputs] == [4] * 5
    assert all(o.finish_reason == "length" for o in outputs)
    assert_idle_and_clean(llm.engine)


@pytest.mark.parametrize(
    "case", ["empty text", "empty ids", "bad id", "bad params", "not a prompt", "params count", "priority count"]
)
def test_generate_rejects_and_next_generate_works(llm, case):
    prompts: list = ["first", {"prompt_token_ids": ids(7)}, "third"]
    params: object = greedy(3)
    kwargs = {}
    if case == "empty text":
        prompts[2], word = "", "empty"
    elif case == "empty ids":
        prompts[1], word = {"prompt_token_ids": []}, "empty"
    elif case == "bad id":
        prompts[2], word = {"prompt_token_ids": [1, 2, VOCAB + 7]}, "outside the vocabulary"
    elif case == "bad params":
        params, word = [greedy(3), greedy(3), mutated(temperature=-1.0)], "temperature"
    elif case == "not a prompt":
        prompts[2], word = {"text": "x"}, "prompt_token_ids"
    elif case == "params count":
        params, word = [greedy(3)] * 2, "2 sampling params for 3 prompts"
    else:
        kwargs, word = {"priority": [0, 1]}, "shorter"
    with pytest.raises(ValueError, match=word):
        llm.generate(prompts, params, **kwargs)
    assert not llm.engine.has_unfinished()
    assert_idle_and_clean(llm.engine)
    outputs = llm.generate(["first", {"prompt_token_ids": ids(7)}, "third"], greedy(3))
    assert [o.finish_reason for o in outputs] == ["length"] * 3
    assert_idle_and_clean(llm.engine)


def test_generate_with_non_list_token_ids_queues_nothing(llm):
    try:
        with pytest.raises(ValueError, match="token ids"):
            llm.generate(["first", {"prompt_token_ids": 5}], greedy(3))
        assert not llm.engine.has_unfinished()
    finally:  # keep the shared engine clean for the other tests whatever happened
        for request_id in list(llm.engine.tracked):
            llm.engine.abort(request_id)


# --- a model step that raises ----------------------------------------------------------------------------------------


def fail_once(engine: Engine, monkeypatch, message: str = "simulated CUDA error") -> list:
    """Makes the next runner.execute raise; returns the list of requests that were in the failing step."""
    original = engine.runner.execute
    in_step: list = []

    def execute(out):
        monkeypatch.setattr(engine.runner, "execute", original)
        in_step.extend(chunk.req.request_id for chunk in out.chunks)
        raise RuntimeError(message)

    monkeypatch.setattr(engine.runner, "execute", execute)
    return in_step


def test_failed_step_fails_only_its_requests(demo_model_dir, monkeypatch):
    llm = make_llm(demo_model_dir, max_num_seqs=2)
    engine = llm.engine
    reference = {
        p: o.token_ids
        for p, o in zip(
            ["a", "b", "c", "d"],
            llm.generate(
                [{"prompt_token_ids": ids(n, start=s)} for n, s in [(20, 100), (40, 200), (17, 300), (33, 400)]],
                greedy(6),
            ),
        )
    }
    assert_idle_and_clean(engine)

    engine.add_request(ids(20, start=100), greedy(6), request_id="a")
    engine.add_request(ids(40, start=200), greedy(6), request_id="b")
    engine.add_request(ids(17, start=300), greedy(6), request_id="c")  # waits: max_num_seqs=2
    first = engine.step()
    assert {o.request_id for o in first} == {"a", "b"}
    engine.step()
    in_step = fail_once(engine, monkeypatch)
    failed = engine.step()
    assert sorted(in_step) == ["a", "b"]
    assert sorted(o.request_id for o in failed) == ["a", "b"]
    for out in failed:
        assert out.finished and out.finish_reason == "error"
        assert "model step failed" in out.error and "simulated CUDA error" in out.error
        assert len(out.token_ids) == 2  # what they had produced before the failure
    assert "a" not in engine.tracked and "b" not in engine.tracked
    assert not engine.abort("a")  # already finished
    # their blocks are free; the waiting one was not touched
    assert [r.request_id for r in engine.scheduler.queue] == ["c"] and not engine.scheduler.running
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks

    engine.add_request(ids(33, start=400), greedy(6), request_id="d")
    engine.add_request(ids(20, start=100), greedy(6), request_id="a")  # a failed id can be reused
    done = run_to_completion(engine)
    assert set(done) == {"c", "d", "a"}
    for name, out in done.items():
        assert out.finish_reason == "length" and out.error is None
        assert out.token_ids == reference[name], f"{name} differs after the failed step"
    assert_idle_and_clean(engine)


def test_failed_prefill_step_then_generate_works(llm, monkeypatch):
    """A failure in the very first step (prefill) of a generate() call returns error outputs, not an exception."""
    engine = llm.engine
    expected = [o.token_ids for o in llm.generate(["one", "two two"], greedy(3))]
    fail_once(engine, monkeypatch, "boom")
    outputs = llm.generate(["one", "two two"], greedy(3))
    assert [o.finish_reason for o in outputs] == ["error", "error"]
    assert all("boom" in o.error and o.token_ids == [] for o in outputs)
    assert_idle_and_clean(engine)
    assert [o.token_ids for o in llm.generate(["one", "two two"], greedy(3))] == expected
    assert_idle_and_clean(engine)


def test_failed_step_does_not_poison_the_prefix_cache(llm, demo_model_dir, monkeypatch):
    """A request failing mid-prefill must not leave its half-written blocks in the prefix cache for later hits."""
    engine = llm.engine
    prompt = ids(64, start=700) + [1, 2, 3]  # four full blocks, never seen by this engine
    cached_before = dict(engine.blocks.cached)
    fail_once(engine, monkeypatch)
    failed = llm.generate({"prompt_token_ids": prompt}, greedy(5))[0]
    assert failed.finish_reason == "error"
    assert engine.blocks.cached == cached_before, "blocks of a failed step were registered in the prefix cache"
    assert_idle_and_clean(engine)
    first = llm.generate({"prompt_token_ids": prompt}, greedy(5))[0]
    second = llm.generate({"prompt_token_ids": prompt}, greedy(5))[0]
    assert second.num_cached_tokens == 64
    uncached = make_llm(demo_model_dir, enable_prefix_caching=False)
    expected = uncached.generate({"prompt_token_ids": prompt}, greedy(5))[0].token_ids
    assert first.token_ids == second.token_ids == expected
    assert_idle_and_clean(engine)
