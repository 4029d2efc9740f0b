"""tool_choice `required` and a named function through the engine, for each format (Hermes on a Qwen3 template,
Llama 3's JSON, Mistral's [TOOL_CALLS] as a special token, and its v11 `[TOOL_CALLS]name[ARGS]{...}` calls): the request's plan (template, format, grammar,
sampling) as the replica makes it, random weights, greedy and sampled; every output that stops is parsed into
calls whose arguments validate against their tool's schema. Also the plan's refusals and where thinking starts."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from tests.checkpoints import SMALL_KV
from tokenfleet import LLM
from tokenfleet.api.chat_plan import ChatPlan, plan_chat
from tokenfleet.api.errors import APIError
from tokenfleet.api.protocol import ChatCompletionRequest
from tokenfleet.api.reasoning import Start

from .conftest import SCHEMAS, TOOLS

MESSAGES = [{"role": "user", "content": "Plan my day."}]
SEEDS = range(4)


def request(**fields) -> ChatCompletionRequest:
    """Qwen3's template thinks unless told not to (see the last test for a call after thinking)."""
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, **fields}
    body.setdefault("chat_template_kwargs", {"enable_thinking": False})
    return ChatCompletionRequest.model_validate(body)


def generate(llm: LLM, req: ChatCompletionRequest) -> tuple[ChatPlan, list]:
    """Greedy and sampled outputs of the request as the replica would run it, each parsed by the plan."""
    prompt = req.render_chat(llm.tokenizer)
    plan = plan_chat(req, llm.tokenizer, prompt)
    greedy = plan.sampling(req.sampling_params(req.requested_max_tokens(), None))
    params = [greedy] + [dataclasses.replace(greedy, temperature=1.0, seed=s) for s in SEEDS]
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params)
    parsed = []
    for out in outs:
        output = plan.output()
        output.feed(out.text, len(out.token_ids))
        output.finish()
        parsed.append((out, output))
    return plan, parsed


@pytest.fixture(scope="module", params=["qwen3", "llama3", "mistral", "mistral_v11"])
def llm(request, template_models) -> LLM:
    return LLM(str(template_models[request.param]), **SMALL_KV)


def assert_valid_calls(parsed: list, allowed: set[str], most: int | None) -> None:
    """Every complete call validates; an output that stopped is calls only. With one call at most, all but one
    output stop (random weights write parallel calls on and on, to max_tokens)."""
    stopped = 0
    for out, output in parsed:
        assert out.finish_reason in ("stop", "length"), (out.finish_reason, out.error)
        for call in output.tool_calls:
            assert call.name in allowed
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        if out.finish_reason == "stop":
            stopped += 1
            assert output.content == "" and output.tool_calls, out.text
            assert most is None or len(output.tool_calls) <= most
    if most == 1:
        assert stopped >= len(parsed) - 1, [out.text for out, _ in parsed]


def test_required_makes_valid_calls_whatever_the_weights(llm):
    plan, parsed = generate(llm, request(tool_choice="required", parallel_tool_calls=False))
    assert plan.grammar is not None
    assert_valid_calls(parsed, set(SCHEMAS), 1)
    _, parallel = generate(llm, request(tool_choice="required"))
    assert_valid_calls(parallel, set(SCHEMAS), None)
    assert any(len(output.tool_calls) > 1 for _, output in parallel)


def test_a_named_function_is_the_one_called_once_without_parallel_calls(llm):
    choice = {"type": "function", "function": {"name": "plan_trip"}}
    _, parsed = generate(llm, request(tool_choice=choice, parallel_tool_calls=False))
    assert_valid_calls(parsed, {"plan_trip"}, 1)


def test_auto_is_unconstrained_and_never_fails(llm):
    plan, parsed = generate(llm, request(tool_choice="auto", max_tokens=40))
    assert plan.grammar is None and plan.tool_format is not None
    for out, output in parsed:
        assert out.finish_reason in ("stop", "length")
        assert output.content or output.tool_calls or out.text == ""


def test_the_mistral_trigger_is_kept_as_text_where_it_is_a_special_token(template_models):
    llm = LLM(str(template_models["mistral"]), **SMALL_KV)
    plan, parsed = generate(llm, request(tool_choice="required"))
    assert plan.keep_special_tokens and "<[" in plan.grammar.spec  # the token itself, not its spelling
    assert all(out.text.startswith("[TOOL_CALLS]") for out, _ in parsed if out.finish_reason == "stop")


def test_mistral_v11_calls_are_its_two_special_tokens_and_a_name(template_models):
    llm = LLM(str(template_models["mistral_v11"]), **SMALL_KV)
    plan, parsed = generate(llm, request(tool_choice="required"))
    assert plan.keep_special_tokens and plan.tool_format.name == "mistral_v11"
    tool_calls, args = (f"<[{llm.tokenizer.token_to_id(token)}]>" for token in ("[TOOL_CALLS]", "[ARGS]"))
    assert tool_calls in plan.grammar.spec and args in plan.grammar.spec
    stopped = [(out, output) for out, output in parsed if out.finish_reason == "stop"]
    assert stopped
    for out, output in stopped:  # the text is the calls, nothing else
        assert out.text == "".join(f"[TOOL_CALLS]{c.name}[ARGS]{c.arguments}" for c in output.tool_calls)
        assert output.content == ""


def test_plans_refuse_what_they_cannot_serve(template_models, demo_model_dir):
    qwen = LLM(str(template_models["qwen3"]), **SMALL_KV).tokenizer
    bad = {
        "required without tools": ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        "named function not in tools": (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        "unknown choice": ({"tool_choice": "sometimes"}, "tool_choice"),
        "not a function tool": ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools"),
        "bad function name": ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        "two tools with one name": ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        "a schema the grammar cannot enforce": (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        "a call and a response_format": (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    }
    for name, (fields, param) in bad.items():
        with pytest.raises(APIError) as refused:
            req = request(**fields)
            plan_chat(req, qwen, req.render_chat(qwen))
            req.structured_output()
        assert refused.value.status == 400 and refused.value.param == param, (name, refused.value)
    plain = LLM(str(demo_model_dir), **SMALL_KV).tokenizer  # ChatML without tools
    req = request()
    with pytest.raises(APIError) as refused:
        plan_chat(req, plain, req.render_chat(plain))
    assert refused.value.param == "tools" and refused.value.code == "unsupported_parameter"
    none = request(tool_choice="none")
    assert plan_chat(none, plain, none.render_chat(plain)) == ChatPlan()


def test_thinking_starts_where_the_template_leaves_it(template_models):
    r1 = LLM(str(template_models["r1"]), **SMALL_KV).tokenizer
    qwen = LLM(str(template_models["qwen3"]), **SMALL_KV).tokenizer
    plain = request(tools=None, chat_template_kwargs={})
    assert plan_chat(plain, r1, plain.render_chat(r1)).reasoning_start is Start.THINKING
    assert plan_chat(plain, qwen, plain.render_chat(qwen)).reasoning_start is Start.MAY_THINK
    off = request(tools=None, chat_template_kwargs={"enable_thinking": False})
    assert plan_chat(off, qwen, off.render_chat(qwen)).reasoning_start is Start.ANSWERING


def test_a_forced_call_may_come_after_thinking(template_models):
    llm = LLM(str(template_models["qwen3"]), **SMALL_KV)
    plan, parsed = generate(llm, request(tool_choice="required", chat_template_kwargs={}))
    assert plan.reasoning_start is Start.MAY_THINK and "think" in plan.grammar.spec
    for out, output in parsed:
        if out.finish_reason == "stop":
            assert output.content == "" and output.tool_calls
            if out.text.startswith("<think>"):
                assert output.reasoning_text and output.reasoning_tokens > 0
            for call in output.tool_calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
