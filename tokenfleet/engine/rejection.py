"""Verifying speculative proposals: the target model's logits at a request's last token and at each of its k
proposals decide how many proposals it keeps, then one token of the target's own follows (the correction at the
first rejection, or a bonus token when every proposal is kept).

The rule is the standard one (Leviathan et al. 2023; Chen et al. 2023): proposal d, drawn from the proposer's
distribution q, is kept with probability min(1, p(d) / q(d)), p being the target's distribution at that position
after every processor that sampling applies; at the first rejection the token is drawn from the residual
max(0, p - q), normalised. Each emitted token is then distributed exactly as the target's own sample. An n-gram
proposal is a point mass (q(d) = 1): kept with probability p(d), the residual is p without d. A greedy request's
p is a point mass at its argmax, so it keeps exactly the proposals that equal its argmax: greedy output is the
same as without speculation.

Row j of a request is processed as if its first j proposals had been appended (RowView): penalties count them,
min_tokens counts them, so a proposal that would break min_tokens (eos too early) is rejected like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenfleet.engine.request import Request, SamplingParams, TokenLogprob
from tokenfleet.engine.sampler import Sampler, collect_logprobs, is_greedy, is_plain_greedy, sample_from
from tokenfleet.engine.scheduler import ScheduledChunk
from tokenfleet.engine.structured import RequestGrammar


@dataclass
class Proposal:
    token_ids: list[int]
    draft_probs: torch.Tensor | None = None  # [n, vocab]: the distribution each was drawn from; None: point masses


@dataclass
class Verified:
    token_ids: list[int]  # the kept proposals, then the target's own token
    logprobs: list[TokenLogprob | None]
    num_accepted: int  # proposals kept


@dataclass(eq=False)
class RowView:
    """A request as the processors see it at a later row of its verification: `ahead` appended to its output."""

    req: Request
    ahead: list[int]

    @property
    def params(self) -> SamplingParams:
        return self.req.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.req.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.req.output_token_ids + self.ahead

    @property
    def num_output_tokens(self) -> int:
        return self.req.num_output_tokens + len(self.ahead)

    @property
    def grammar(self) -> RequestGrammar | None:
        return self.req.grammar

    @property
    def generator(self) -> torch.Generator | None:
        return self.req.generator


def rows_ahead(req: Request, proposals: Sequence[int]) -> list[RowView]:
    """The request's verification rows: at its last token, then after each proposal."""
    return [RowView(req, list(proposals[:j])) for j in range(len(proposals) + 1)]


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(
        self,
        logits: torch.Tensor,
        starts: Sequence[int],
        chunks: Sequence[ScheduledChunk],
        proposals: Sequence[Proposal],
    ) -> list[Verified]:
        """Each chunk owns 1 + len(chunk.spec_token_ids) consecutive rows of logits, from its start on."""
        last = max(s + len(c.spec_token_ids) for s, c in zip(starts, chunks)) if chunks else -1
        if last >= logits.shape[0]:
            raise ValueError(f"expected at least {last + 1} rows of logits to verify, got {logits.shape[0]}")
        plain = [i for i, c in enumerate(chunks) if is_plain_greedy(c.req)]
        results: list[Verified | None] = [None] * len(chunks)
        for i, verified in zip(plain, self._greedy([chunks[i] for i in plain], [starts[i] for i in plain], logits)):
            results[i] = verified
        processed = [i for i in range(len(chunks)) if results[i] is None]
        if processed:
            rows = [view for i in processed for view in rows_ahead(chunks[i].req, chunks[i].spec_token_ids)]
            index = torch.cat(
                [torch.arange(starts[i], starts[i] + 1 + len(chunks[i].spec_token_ids)) for i in processed]
            )
            probs = self.sampler.probabilities(logits.index_select(0, index.to(logits.device)), rows)
            at = 0
            for i in processed:
                n = 1 + len(chunks[i].spec_token_ids)
                results[i] = self._by_probabilities(chunks[i], proposals[i], probs[at : at + n])
                at += n
        return [self._with_logprobs(logits, start, chunk, v) for start, chunk, v in zip(starts, chunks, results)]

    @staticmethod
    def _greedy(chunks: list[ScheduledChunk], starts: list[int], logits: torch.Tensor) -> list[Verified]:
        """Greedy requests whose raw logits decide: keep proposals while they equal the target's argmax."""
        if not chunks:
            return []
        index = torch.cat([torch.arange(s, s + 1 + len(c.spec_token_ids)) for s, c in zip(starts, chunks)])
        argmax = logits.index_select(0, index.to(logits.device)).argmax(dim=-1).tolist()
        out, at = [], 0
        for chunk in chunks:
            targets = argmax[at : at + 1 + len(chunk.spec_token_ids)]
            at += len(targets)
            kept = 0
            for proposal, target in zip(chunk.spec_token_ids, targets):
                if proposal != target:
                    break
                kept += 1
            out.append(Verified(targets[: kept + 1], [], kept))
        return out

    @staticmethod
    def _by_probabilities(chunk: ScheduledChunk, proposal: Proposal, p: torch.Tensor) -> Verified:
        """The rejection rule on the target's processed distributions p ([1 + k, vocab]) of one request."""
        req, tokens = chunk.req, chunk.spec_token_ids
        generator = req.generator
        greedy = is_greedy(req.params)  # p is one-hot: keep exactly the argmax, no draw needed
        for j, d in enumerate(tokens):
            p_d = p[j, d].item()
            q_d = 1.0 if proposal.draft_probs is None else proposal.draft_probs[j, d].item()
            if greedy:
                keep = p_d == 1.0
            else:
                keep = torch.rand(1, generator=generator).item() * q_d < p_d
            if not keep:
                residual = _residual(p[j], d, None if proposal.draft_probs is None else proposal.draft_probs[j])
                return Verified([*tokens[:j], _draw(residual, generator, greedy)], [], j)
        return Verified([*tokens, _draw(p[len(tokens)].clone(), generator, greedy)], [], len(tokens))

    @staticmethod
    def _with_logprobs(logits: torch.Tensor, start: int, chunk: ScheduledChunk, verified: Verified | None) -> Verified:
        """Logprobs of each emitted token, from the raw logits of the row that emitted it."""
        if verified is None:
            raise RuntimeError(f"request {chunk.req.request_id} was not verified")
        n = len(verified.token_ids)
        if chunk.req.params.logprobs is None:
            verified.logprobs = [None] * n
            return verified
        rows = logits[start : start + n]
        verified.logprobs = collect_logprobs(rows, [chunk.req] * n, list(range(n)), verified.token_ids)
        return verified


def _residual(p: torch.Tensor, proposal: int, q: torch.Tensor | None) -> torch.Tensor:
    """max(0, p - q), a point mass at the proposal when q is None; p itself if that leaves nothing (p == q up to
    rounding: the rejection then had probability ~0)."""
    if q is None:
        residual = p.clone()
        residual[proposal] = 0.0
    else:
        residual = (p - q).clamp_(min=0.0)
    return residual if residual.sum().item() > 0.0 else p.clone()


def _draw(probs: torch.Tensor, generator: torch.Generator | None, greedy: bool) -> int:
    if greedy:
        return int(probs.argmax().item())
    return int(sample_from(probs.unsqueeze(0), [generator]).item())
