"""The request record that flows one way through the engine: waiting -> running (<-> swapped) -> finished."""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    import torch

    from tokenfleet.engine.structured import RequestGrammar

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
STRUCTURED_KINDS: tuple[str, ...] = get_args(StructuredKind)


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. `spec` is the JSON schema's text (json_schema), the regular expression (regex,
    matched in full), a JSON list of the allowed strings (choice), a Lark or GBNF grammar (grammar), or "" for any
    JSON object (json_object). Build one with the constructors below."""

    kind: StructuredKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"a structured output's spec is a string, got {type(self.spec).__name__}")
        if self.kind == "json_object" and self.spec:
            raise ValueError("json_object takes no spec")
        if self.kind in ("regex", "grammar") and not self.spec:
            raise ValueError(f"the {self.kind} must not be empty")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> StructuredOutput:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, Mapping):
            raise ValueError(f"a JSON schema is a JSON object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredOutput:
        if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("a choice is a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def grammar(cls, grammar: str) -> StructuredOutput:
        return cls("grammar", grammar)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; the fields and defaults follow vLLM's SamplingParams."""

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return besides the sampled token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    detokenize: bool = True  # False: token ids only (no text, no stop strings), as in vLLM
    structured_output: StructuredOutput | None = None  # the output must match it (vLLM's structured_outputs)
    skip_special_tokens: bool = True  # False: special tokens are in the text (a tool-call format that starts with one)
    speculative_decoding: bool = True  # False: this request never gets speculative proposals (a per-request opt-out)
    kv_export: bool = False  # True: its prompt's KV blocks come out with its outputs (a prefill replica's request)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            ),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1 (disabled) or >= 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.detokenize or not self.stop, "stop strings need detokenize=True"),
            (
                self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
                f"structured_output must be a StructuredOutput, got {type(self.structured_output).__name__}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass(eq=False)
class Request:
    """One generation. `token_ids` is prompt + output; `num_computed_tokens` of them have KV in the cache."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower number = more important
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission; -1 = not admitted yet
    block_table: list[int] = field(default_factory=list)  # device blocks, or host blocks while swapped
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks
    num_cached_blocks: int = 0  # leading blocks of block_table already registered in the prefix cache
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_preemptions: int = 0
    engine_s: float = 0.0  # its share of the engine's step time so far (for cost per token)
    generator: torch.Generator | None = None
    grammar: RequestGrammar | None = None  # its structured output's matcher, advanced on every accepted token
    # speculative decoding: proposals the next step may verify (set before scheduling), and the leading tokens
    # whose KV the draft model's cache holds (draft_model only; it may lag the target's by a token or two)
    num_lookahead_tokens: int = 0
    num_draft_computed: int = 0
    # its timeline in the engine: when a step first took it (time.monotonic()), and how many steps prefilled it
    scheduled_time: float | None = None
    num_prefill_chunks: int = 0
    num_exported_blocks: int = 0  # kv_export: leading prompt blocks whose KV went out already

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            import torch  # here, not at the top: the gateway, router and simulator use requests without PyTorch

            # torch takes seeds in [-2**63, 2**64) (a negative one counts as seed + 2**64): any other int wraps
            # the same way instead of failing the request
            self.generator = torch.Generator().manual_seed(self.params.seed % 2**64)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def rank(self) -> tuple[int, float]:
        """Queue order: most important class first, then first come first served (kept across preemption)."""
        return (self.priority, self.arrival_time)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def append_tokens(self, token_ids: Iterable[int]) -> None:
        self.token_ids.extend(token_ids)
