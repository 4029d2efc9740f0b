"""What the engine hands out: each request's outputs, and where step time went. The records a server reads.

The server process of `tokenfleet serve` and `tokenfleet replica` talks to the engine process through a pipe and
only reads these (unpickling one imports its module), so they live here rather than beside Engine: importing them
must not load the model code or PyTorch."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenfleet.engine.kv_transfer import KVChunk
from tokenfleet.engine.request import TokenLogprob


@dataclass(frozen=True)
class RequestTiming:
    """Where a request's time to first token went inside the engine (time.monotonic() instants, comparable across
    the processes of one host): waiting in the engine's queue until a step first took it, then its prefill."""

    arrival_time: float  # added to the engine
    scheduled_time: float | None  # first taken into a step (None: never, e.g. refused before)
    num_prefill_chunks: int  # steps that computed its prompt (chunked prefill)


@dataclass
class RequestOutput:
    """What a request produced so far; `new_*` fields hold what this step added."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    num_cached_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    engine_s: float = 0.0  # the request's share of engine step time so far
    timing: RequestTiming | None = None  # on the output with the request's first token (and a failure's) only
    kv_chunk: KVChunk | None = None  # kv_export: prompt blocks this step computed (an output may carry no token)


@dataclass
class StepStats:
    """Where step time goes (cumulative seconds). On CUDA, forward_s includes waiting for the GPU at sampling."""

    steps: int = 0
    schedule_s: float = 0.0
    propose_s: float = 0.0  # speculative proposals (a draft model's passes)
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    output_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.propose_s + self.prepare_s + self.forward_s + self.sample_s + self.output_s

    def overhead_fraction(self) -> float:
        """Share of step time spent outside the model and the sampler: scheduling, batch preparation, outputs."""
        return (self.schedule_s + self.prepare_s + self.output_s) / self.total_s if self.total_s else 0.0
