"""Whatever one request costs, the server's event loop keeps serving everyone else: absurd fan-out (n x prompts) is
refused with a 400 against documented limits, and the largest request allowed, or a megabyte of prompt text to
tokenize, leaves /health answering promptly."""

from __future__ import annotations

import threading
import time

import httpx

from tests.chaos.conftest import CHAT, MODEL, TEXT, assert_openai_error, post
from tokenfleet.api.protocol import MAX_CHOICES, MAX_N, MAX_PROMPTS

# The defect was stalls of seconds; a loop that keeps serving answers /health in milliseconds even on a busy
# two-core machine, so a second is generous.
HEALTH_BOUND_S = 1.0


class HealthProbe:
    """Polls /health on one keep-alive connection while the block runs; `worst` is the slowest answer."""

    def __init__(self, base: str) -> None:
        self.base, self.latencies = base, []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        while not self.latencies:  # a first answer before the request under test goes out
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=60)

    def _poll(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._done.is_set():
                started = time.monotonic()
                try:
                    healthy = client.get(f"{self.base}/health").status_code == 200
                except httpx.HTTPError:
                    healthy = False
                self.latencies.append(time.monotonic() - started if healthy else float("inf"))
                time.sleep(0.02)

    @property
    def worst(self) -> float:
        return max(self.latencies)


def test_absurd_fan_out_is_refused(server):
    started = time.monotonic()
    error = assert_openai_error(
        post(server, TEXT, {"model": MODEL, "prompt": [[5]] * 200, "n": 128, "max_tokens": 1}), 400, "n"
    )
    assert error["code"] == "too_many_choices" and str(MAX_CHOICES) in error["message"]
    error = assert_openai_error(
        post(server, TEXT, {"model": MODEL, "prompt": [[5]] * (MAX_PROMPTS + 1), "max_tokens": 1}), 400, "prompt"
    )
    assert error["code"] == "too_many_prompts"
    assert_openai_error(post(server, TEXT, {"model": MODEL, "prompt": ["x"] * 200_000, "max_tokens": 1}), 400, "prompt")
    assert_openai_error(
        post(server, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": MAX_N + 1}), 400, "n"
    )
    assert time.monotonic() - started < 30  # refused up front, not after the work


def test_the_largest_fan_out_leaves_the_server_responsive(server):
    prompts = [[5 + i] for i in range(MAX_CHOICES // MAX_N)]
    with HealthProbe(server) as probe:
        response = post(
            server, TEXT, {"model": MODEL, "prompt": prompts, "n": MAX_N, "max_tokens": 4, "ignore_eos": True}
        )
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == MAX_CHOICES and {c["finish_reason"] for c in choices} == {"length"}
    assert probe.worst < HEALTH_BOUND_S, f"/health took {probe.worst:.2f} s during the request"


def test_a_megabyte_of_prompt_text_leaves_the_server_responsive(server):
    text = "The quick brown fox jumps over the lazy dog. " * 23_000  # ~1 MB: seconds of tokenizing
    with HealthProbe(server) as probe:
        response = post(server, TEXT, {"model": MODEL, "prompt": text, "max_tokens": 1})
    assert_openai_error(response, 400, "prompt")  # far longer than the context window
    assert probe.worst < HEALTH_BOUND_S, f"/health took {probe.worst:.2f} s while the prompt was tokenized"
