"""Every error in OpenAI's shape, the framework's own 404 and 405 included: the SDK then shows what went wrong
instead of a bare "Error code: 404"."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.chaos.conftest import assert_openai_error


def test_an_unknown_route_is_a_404_the_sdk_can_read(server):
    error = assert_openai_error(httpx.get(f"{server}/v1/nope", timeout=10), 404, param=None)
    assert error["code"] == "unknown_route" and "/v1/nope" in error["message"]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as raised:
        client.get("/nope", cast_to=object)
    assert "no route GET /v1/nope" in str(raised.value)


def test_a_wrong_method_is_a_405_naming_the_allowed_ones(server):
    response = httpx.get(f"{server}/v1/completions", timeout=10)
    error = assert_openai_error(response, 405, param=None)
    assert error["code"] == "method_not_allowed" and "POST" in error["message"]
    assert "POST" in response.headers["allow"]
