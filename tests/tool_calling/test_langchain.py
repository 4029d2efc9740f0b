"""LangChain's ChatOpenAI against `tokenfleet serve --auth` (Qwen3-template checkpoint, random weights):
`bind_tools` with a required tool choice gets tool calls whose arguments are the tool's, and
`with_structured_output` gets the Pydantic object itself."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from .conftest import MODEL

langchain_openai = pytest.importorskip("langchain_openai")


class GetWeather(BaseModel):
    """The weather in a city."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=8)
    unit: Literal["c", "f"]


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


@pytest.fixture
def chat(qwen_platform):
    return langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=f"{qwen_platform.base}/v1",
        api_key=qwen_platform.keys["paid"],
        temperature=0,
        max_tokens=120,
        max_retries=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )


def test_bind_tools_returns_tool_calls(chat):
    model = chat.bind_tools([GetWeather], tool_choice="required", strict=True, parallel_tool_calls=False)
    message = model.invoke("What is the weather in Oslo?")
    [call] = message.tool_calls
    assert call["name"] == "GetWeather" and call["id"]
    GetWeather.model_validate(call["args"])
    streamed = None
    for piece in model.stream("What is the weather in Oslo?"):
        streamed = piece if streamed is None else streamed + piece
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]


def test_with_structured_output_returns_the_pydantic_object(chat):
    person = chat.with_structured_output(Person).invoke("Describe someone.")
    assert isinstance(person, Person)
