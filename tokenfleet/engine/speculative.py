"""Speculative decoding in the step: before scheduling, each decoding request that may speculate says how many
proposals it wants verified (the scheduler counts them in its token budget and allocates their slots with the
request's next token); after scheduling, the proposer fills in the granted proposals; the target verifies them
all in its one forward pass (engine/rejection.py), and the step's accounting keeps only the accepted ones.

A request speculates unless it opted out (SamplingParams.speculative_decoding=False) or has a structured output:
those are sampled under their grammar's token mask one token per step (proposals would need a mask per position,
computed by advancing and rolling back the matcher; not done yet). Proposals never run past max_tokens or the
model's context: k is capped so that the accepted run plus the target's token still fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenfleet.engine.config import SpeculativeConfig
from tokenfleet.engine.rejection import Proposal
from tokenfleet.engine.request import Request
from tokenfleet.engine.scheduler import ScheduledChunk, SchedulerOutput
from tokenfleet.engine.state import SpecDecodeStats


class Proposer(Protocol):
    def plan(self, req: Request, limit: int) -> int:
        """How many proposals (at most `limit`) the request would like verified in the next step."""
        ...

    def propose(self, chunks: Sequence[ScheduledChunk]) -> list[Proposal]:
        """Exactly chunk.num_lookahead proposals for each chunk, whose slots the scheduler allocated."""
        ...


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config, self.proposer, self.max_model_len = config, proposer, max_model_len
        self.stats = SpecDecodeStats(accepted_per_position=[0] * config.num_speculative_tokens)

    def plan(self, running: Sequence[Request]) -> None:
        """Sets every running request's num_lookahead_tokens for the next schedule."""
        for req in running:
            limit = self._limit(req)
            req.num_lookahead_tokens = self.proposer.plan(req, limit) if limit > 0 else 0

    def _limit(self, req: Request) -> int:
        """Proposals the request may have verified now: k, fewer near max_tokens or the context's end (the
        verification emits up to one token more than it verifies), none when it may not speculate."""
        params = req.params
        if not params.speculative_decoding or req.grammar is not None or req.num_uncomputed_tokens != 1:
            return 0
        room = self.max_model_len - req.num_tokens
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - req.num_output_tokens)
        return min(self.config.num_speculative_tokens, room - 1)

    def propose(self, out: SchedulerOutput) -> dict[Request, Proposal]:
        """Fills in the proposals of the chunks that were granted lookahead; returns them by request."""
        chunks = [c for c in out.chunks if c.num_lookahead]
        proposals = self.proposer.propose(chunks) if chunks else []
        for chunk, proposal in zip(chunks, proposals, strict=True):
            if len(proposal.token_ids) != chunk.num_lookahead:
                raise RuntimeError(
                    f"the proposer gave {len(proposal.token_ids)} proposals for {chunk.num_lookahead} slots"
                )
            chunk.spec_token_ids = proposal.token_ids
        return {c.req: p for c, p in zip(chunks, proposals)}
