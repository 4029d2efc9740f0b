"""What makes a request impossible for an engine to serve, checkable without the engine (e.g. in the process
that talks to an engine running in another one)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.engine.request import SamplingParams
from tokenfleet.engine.structured import check_structured_output


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    watermark_blocks: int
    has_tokenizer: bool

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError naming what makes this request impossible to serve."""
        vocab = self.vocab_size
        if params.stop and not self.has_tokenizer:
            raise ValueError("stop strings need the tokenizer; this engine runs without one")
        if params.structured_output is not None:
            if not self.has_tokenizer:
                raise ValueError("structured outputs need the tokenizer; this engine runs without one")
            check_structured_output(params.structured_output)
        if not token_ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        n, limit = len(token_ids), self.max_model_len
        if n >= limit:
            raise ValueError(
                f"the prompt has {n} tokens, but this model's maximum context length is {limit} "
                f"tokens (prompt plus at least one generated token)"
            )
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise ValueError(
                f"this model's maximum context length is {limit} tokens; you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} to generate)"
            )
        needed = -(-(n + (params.max_tokens or limit - n)) // self.block_size)
        capacity = self.num_blocks - self.watermark_blocks
        if needed > capacity:
            raise ValueError(
                f"the request needs {needed} KV cache blocks, but the cache holds {capacity}; "
                f"lower max_tokens or give the KV cache more memory"
            )
