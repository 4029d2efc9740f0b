"""Structured outputs through the engine (LLM and Engine) on the demo checkpoint (random weights, a real tokenizer):
every output that stops validates (JSON schema), matches (regex) or is one of the choices, whatever the weights,
in mixed batches, with chunked prefill, prefix-cache hits, preemption by recompute and by swap, and cancellation.
An output cut by max_tokens (finish_reason "length") is exempt, as with OpenAI."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.checkpoints import SMALL_KV
from tokenfleet import LLM, SamplingParams
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.engine import Engine, RequestOutput
from tokenfleet.engine.request import RequestStatus, StructuredOutput

# Every string bounded: with random weights a free string closes only when a quote happens to win.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "zip", "color", "tags", "ok"],
    "additionalProperties": False,
}
PERSON_SPEC = StructuredOutput.json_schema(PERSON)
PROMPT = "Reply with the person as JSON:"


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(str(demo_model_dir), **SMALL_KV)


def params(spec: StructuredOutput | None, max_tokens: int = 64, seed: int | None = None, **more) -> SamplingParams:
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, structured_output=spec, **more)


def assert_valid_json(out: RequestOutput, schema: dict) -> None:
    if out.finish_reason == "length":
        return
    assert out.finish_reason == "stop", (out.finish_reason, out.error)
    jsonschema.validate(json.loads(out.text), schema)


def test_json_schema_outputs_validate_greedy_and_sampled(llm):
    outs = llm.generate([PROMPT] * 6, [params(PERSON_SPEC)] + [params(PERSON_SPEC, seed=s) for s in range(5)])
    for out in outs:
        assert out.finish_reason == "stop" and out.stop_reason is None, (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), PERSON)
    # the output ends where the grammar does: its last token is the closing brace, no eos text after it
    assert all(out.text.endswith("}") for out in outs)
    assert llm.engine.grammars.misses >= 1 and llm.engine.grammars.hits >= 5  # compiled once, then cached


def test_regex_choice_grammar_and_json_object(llm):
    zip_code = StructuredOutput.regex(r"[0-9]{3}-[a-c]{2,4}")
    choice = StructuredOutput.choice(["yes", "no", "maybe so"])
    lark = StructuredOutput.grammar('start: "(" num ("+" num)* ")"\nnum: /[1-9]/')
    gbnf = StructuredOutput.grammar('root ::= "v" [0-9] [0-9]? "." [0-9]')
    specs = [zip_code, zip_code, choice, choice, lark, gbnf, StructuredOutput.json_object()]
    outs = llm.generate([PROMPT] * len(specs), [params(spec, seed=i) for i, spec in enumerate(specs)])
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2,4}", outs[0].text) and re.fullmatch(r"[0-9]{3}-[a-c]{2,4}", outs[1].text)
    assert outs[2].text in ("yes", "no", "maybe so") and outs[3].text in ("yes", "no", "maybe so")
    assert outs[4].finish_reason == "length" or re.fullmatch(r"\([1-9](\+[1-9])*\)", outs[4].text)
    assert re.fullmatch(r"v[0-9][0-9]?\.[0-9]", outs[5].text)
    assert all(out.finish_reason == "stop" for out in outs[:4] + outs[5:6])
    if outs[6].finish_reason == "stop":
        assert isinstance(json.loads(outs[6].text), dict)


def test_mixed_batch_leaves_unconstrained_rows_alone(llm):
    free = [params(None, max_tokens=16, ignore_eos=True), params(None, max_tokens=16, seed=7, ignore_eos=True)]
    alone = llm.generate(["Tell me about lists", "Tell me about tuples"], free)
    mixed = llm.generate(
        ["Tell me about lists", PROMPT, "Tell me about tuples", PROMPT],
        [free[0], params(PERSON_SPEC), free[1], params(PERSON_SPEC, seed=3)],
    )
    assert [mixed[0].token_ids, mixed[2].token_ids] == [alone[0].token_ids, alone[1].token_ids]
    for out in (mixed[1], mixed[3]):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)


def test_chunked_prefill_and_prefix_cache_hits(demo_model_dir, llm):
    reference = llm.generate(PROMPT * 12, params(PERSON_SPEC))[0]
    chunked = LLM(str(demo_model_dir), max_num_batched_tokens=16, **SMALL_KV)
    first, second = (chunked.generate(PROMPT * 12, params(PERSON_SPEC))[0] for _ in range(2))
    assert second.num_cached_tokens >= 32  # the second run's prompt came from the prefix cache
    assert first.token_ids == second.token_ids == reference.token_ids
    assert_valid_json(first, PERSON)
    assert first.finish_reason == "stop"


@pytest.mark.parametrize("swap_threshold", [10_000, 8], ids=["recompute", "swap"])
def test_preemption_by_priority_keeps_the_matcher_in_step(demo_model_dir, llm, swap_threshold):
    """Low-priority structured requests are preempted mid-output by a more important one; resumed, their matchers
    are where they were (a matcher fed twice would refuse the next token or change the output)."""
    prompts = [PROMPT + " first", PROMPT + " second"]
    expected = llm.generate(prompts, [params(PERSON_SPEC), params(PERSON_SPEC, seed=5)])
    engine = Engine(
        EngineConfig.from_options(str(demo_model_dir), max_num_seqs=2, swap_threshold_tokens=swap_threshold, **SMALL_KV)
    )
    statuses = []
    original_preempt = engine.scheduler._preempt

    def spy(req, out):
        refund = original_preempt(req, out)
        statuses.append(req.status)
        return refund

    engine.scheduler._preempt = spy
    low = [
        engine.add_request(prompts[0], params(PERSON_SPEC), priority=5),
        engine.add_request(prompts[1], params(PERSON_SPEC, seed=5), priority=5),
    ]
    while min(r.num_output_tokens for r in low) < 6:
        engine.step()
    urgent = engine.add_request("Now this:", params(StructuredOutput.choice(["ok", "no"])), priority=0)
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert (RequestStatus.SWAPPED if swap_threshold == 8 else RequestStatus.WAITING) in statuses
    assert sum(r.num_preemptions for r in low) >= 1
    assert outputs[urgent.request_id].text in ("ok", "no")
    for req, reference in zip(low, expected):
        out = outputs[req.request_id]
        assert out.token_ids == reference.token_ids and out.finish_reason == reference.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
        assert req.grammar.num_consumed == len(out.token_ids)


def test_cancel_mid_output_leaves_the_others_and_the_cache_intact(demo_model_dir, llm):
    expected = llm.generate(PROMPT, params(PERSON_SPEC))[0]
    engine = Engine(EngineConfig.from_options(str(demo_model_dir), **SMALL_KV))
    doomed = engine.add_request(PROMPT, params(PERSON_SPEC), request_id="doomed")
    kept = engine.add_request(PROMPT, params(PERSON_SPEC, seed=1), request_id="kept")
    for _ in range(5):
        engine.step()
    assert doomed.num_output_tokens > 0 and engine.abort("doomed")
    fresh = engine.add_request(PROMPT, params(PERSON_SPEC), request_id="fresh")  # the same compiled grammar
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert doomed.finish_reason == "abort" and set(outputs) == {"kept", "fresh"}
    assert outputs["fresh"].token_ids == expected.token_ids  # the cached template was never advanced
    for out in outputs.values():
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
    assert engine.grammars.misses == 1
    assert kept.grammar.num_consumed == len(outputs["kept"].token_ids)
    assert fresh.grammar.num_consumed == len(outputs["fresh"].token_ids)


def test_max_tokens_cuts_with_length_and_the_grammar_beats_ignore_eos(llm):
    cut = llm.generate(PROMPT, params(PERSON_SPEC, max_tokens=5))[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5 and cut.text.startswith("{")
    choice = StructuredOutput.choice(["alpha", "beta"])
    ended = llm.generate(PROMPT, params(choice, max_tokens=30, ignore_eos=True, min_tokens=1))[0]
    assert ended.finish_reason == "stop" and ended.text in ("alpha", "beta")


def test_rewound_request_rolls_its_matcher_back(llm):
    """catch_up follows the request's tokens both ways (the fleet simulator's unpark drops tokens)."""
    grammar = llm.engine.grammars.matcher(PERSON_SPEC)
    tokens = llm.tokenizer.encode('{"name":"ab","age":7', add_special_tokens=False)
    grammar.catch_up(tokens)
    assert grammar.num_consumed == len(tokens)
    grammar.catch_up(tokens[:3])
    assert grammar.num_consumed == 3
    grammar.catch_up(tokens)  # the same tokens again are accepted: the rollback left it where it was after 3
    assert grammar.num_consumed == len(tokens)


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutput.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
        (StructuredOutput.json_schema({"type": "strin"}), "strin"),
        (StructuredOutput.regex("(?=a)b"), "look-around"),
        (StructuredOutput.grammar("start: ("), "Expected"),
        (StructuredOutput.grammar("start: <|no_such_token|>"), "special token"),  # only the tokenizer knows
        (StructuredOutput.regex("a{0}"), "empty output"),
    ],
)
def test_unsupported_specs_are_refused_up_front(llm, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(PROMPT, params(spec))
    assert not llm.engine.has_unfinished()


def test_structured_output_needs_a_tokenizer(demo_model_dir):
    engine = Engine(EngineConfig.from_options(str(demo_model_dir), skip_tokenizer_init=True, **SMALL_KV))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request([5, 6, 7], params(PERSON_SPEC))


# --- generated schemas ------------------------------------------------------------------------------------------

_NAMES = st.sampled_from(["a", "b", "id", "name", "value", "kind"])
_PATTERNS = st.sampled_from(["^[a-z]{1,4}$", "^[0-9]{2,3}$", "^[A-F0-9]{4}$", "^(yes|no)$", "^[a-c]+-[0-9]$"])


def _bounded_numbers(kind: str) -> st.SearchStrategy[dict]:
    bounds = st.integers(-1000, 1000).flatmap(lambda low: st.tuples(st.just(low), st.integers(low, low + 500)))
    return bounds.map(lambda b: {"type": kind, "minimum": b[0], "maximum": b[1]})


_LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    _bounded_numbers("integer"),
    _bounded_numbers("number"),
    st.integers(1, 8).map(lambda n: {"type": "string", "maxLength": n}),
    _PATTERNS.map(lambda p: {"type": "string", "pattern": p}),
    st.lists(st.text("abcxyz ", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}
    ),
    st.lists(st.integers(-5, 50), min_size=1, max_size=4, unique=True).map(lambda values: {"enum": values}),
    st.sampled_from(["on", 3, True]).map(lambda value: {"const": value}),
)


def _objects(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    props = st.dictionaries(_NAMES, children, min_size=1, max_size=3)
    return props.flatmap(
        lambda p: st.lists(st.sampled_from(sorted(p)), unique=True).map(
            lambda required: {
                "type": "object",
                "properties": p,
                "required": required,
                "additionalProperties": False,
            }
        )
    )


def _arrays(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.tuples(children, st.integers(0, 1), st.integers(1, 3)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": max(t[1], t[2])}
    )


SCHEMAS = st.recursive(
    _LEAVES,
    lambda children: st.one_of(
        _objects(children),
        _arrays(children),
        st.lists(children, min_size=2, max_size=2).map(lambda options: {"anyOf": options}),
    ),
    max_leaves=6,
)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS)
def test_generated_schemas_always_validate(llm, schema):
    spec = StructuredOutput.json_schema(schema)
    outs = llm.generate([PROMPT] * 2, [params(spec, max_tokens=32), params(spec, max_tokens=32, seed=11)])
    for out in outs:
        assert out.finish_reason in ("stop", "length"), (out.finish_reason, out.error)
        assert_valid_json(out, schema)
