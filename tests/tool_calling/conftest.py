"""Checkpoints with tool-calling templates (copies of the demo checkpoint: random weights, its tokenizer), and the
tools the tests call, every string and array bounded so that random weights finish a call well within max_tokens."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field

from tests.gateway.conftest import TENANCY, Platform, with_tenants
from tests.servers import free_port, running_process

from .template_checkpoints import with_template
from .templates import LLAMA31, MISTRAL, MISTRAL_V11, QWEN3, R1


class Place(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str = Field(pattern=r"^[A-Z]{3}$")


class Trip(BaseModel):
    """Nested models: the schema has $defs and $refs, which the call grammar must carry over."""

    model_config = ConfigDict(extra="forbid")
    origin: Place
    stops: list[Place] = Field(max_length=2)


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["tz"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "plan_trip": Trip.model_json_schema()}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]


@pytest.fixture(scope="session")
def template_models(demo_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tool-templates")
    return {
        "qwen3": with_template(demo_model_dir, root / "qwen3", QWEN3),
        "llama3": with_template(demo_model_dir, root / "llama3", LLAMA31),
        "mistral": with_template(demo_model_dir, root / "mistral", MISTRAL, "[TOOL_CALLS]"),
        "mistral_v11": with_template(demo_model_dir, root / "mistral_v11", MISTRAL_V11, "[TOOL_CALLS]", "[ARGS]"),
        "r1": with_template(demo_model_dir, root / "r1", R1),
    }


MODEL = "tiny"
SERVER_ARGS = ["--served-model-name", MODEL, "--kv-cache-gib", "0.05", "--swap-space-gib", "0.01"]


@pytest.fixture(scope="session")
def qwen_replica(template_models, tmp_path_factory):
    """`tokenfleet replica` on the Qwen3-template checkpoint (Hermes calls, thinking)."""
    logs = tmp_path_factory.mktemp("tools-replica")
    port = free_port()
    args = ["replica", "--model", str(template_models["qwen3"]), "--port", str(port), *SERVER_ARGS]
    with running_process(args + ["--max-model-len", "2048"], f"http://127.0.0.1:{port}/health", logs / "log"):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def qwen_platform(template_models, tmp_path_factory):
    """`tokenfleet serve --auth` on the same checkpoint: gateway (keys, quotas, Responses API) and engine, with
    the tenancy of tests/gateway (a context of 2048 tokens: three tools' definitions take ~650 of them)."""
    logs = tmp_path_factory.mktemp("tools-serve")
    (logs / "fleet.yaml").write_text(yaml.safe_dump(TENANCY))
    port, database = free_port(), f"sqlite:///{logs / 'tenants.db'}"
    args = ["serve", "--model", str(template_models["qwen3"]), "--port", str(port), *SERVER_ARGS]
    args += ["--max-model-len", "2048", "--auth", "--config", str(logs / "fleet.yaml"), "--database-url", database]
    with running_process(args, f"http://127.0.0.1:{port}/health", logs / "serve.log"):
        yield with_tenants(Platform(f"http://127.0.0.1:{port}", "embedded", logs / "serve.log", database_url=database))


@pytest.fixture(params=["replica", "platform"])
def client(request) -> openai.OpenAI:
    """The official SDK against our replica directly, and through the platform's gateway."""
    if request.param == "replica":
        return openai.OpenAI(base_url=f"{request.getfixturevalue('qwen_replica')}/v1", api_key="-", max_retries=0)
    platform = request.getfixturevalue("qwen_platform")
    return openai.OpenAI(base_url=f"{platform.base}/v1", api_key=platform.keys["paid"], max_retries=0)
