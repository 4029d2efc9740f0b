"""Real servers for the hostile-input tests: `tokenfleet serve` (gateway + engine, SQLite for conversations) and a
`tokenfleet replica`, started once for the package; and how those tests talk to them."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.servers import free_port, running_process

MODEL = "tiny"
VOCAB = 4096  # the demo "tiny" checkpoint's
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
SMALL = ["--served-model-name", MODEL, "--kv-cache-gib", "0.05", "--swap-space-gib", "0.01", "--max-model-len", "512"]


@pytest.fixture(scope="session")
def serve(demo_model_dir, tmp_path_factory) -> str:
    logs = tmp_path_factory.mktemp("chaos-serve")
    port = free_port()
    args = [
        "serve",
        "--model",
        str(demo_model_dir),
        "--port",
        str(port),
        *SMALL,
        "--database-url",
        f"sqlite:///{logs / 'serve.db'}",
    ]
    with running_process(args, f"http://127.0.0.1:{port}/health", logs / "serve.log", timeout=300):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def replica(demo_model_dir, tmp_path_factory) -> str:
    logs = tmp_path_factory.mktemp("chaos-replica")
    port = free_port()
    args = ["replica", "--model", str(demo_model_dir), "--port", str(port), *SMALL]
    with running_process(args, f"http://127.0.0.1:{port}/health", logs / "replica.log", timeout=300):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(params=["serve", "replica"])
def server(request) -> str:
    """Each test that takes it runs against the gateway and against a replica."""
    return request.getfixturevalue(request.param)


def assert_openai_error(response: httpx.Response, status: int = 400, param: str | None = "any") -> dict:
    """The response is OpenAI's error shape with this status (and this param, unless "any"); returns the error."""
    assert response.status_code == status, response.text[:1000]
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    if param != "any":
        assert error["param"] == param, error
    return error


def post_raw(base: str, path: str, content: bytes, **kwargs) -> httpx.Response:
    return httpx.post(
        f"{base}{path}", content=content, headers={"content-type": "application/json"}, timeout=60, **kwargs
    )


def post(base: str, path: str, body: dict) -> httpx.Response:
    return post_raw(base, path, json.dumps(body).encode())
