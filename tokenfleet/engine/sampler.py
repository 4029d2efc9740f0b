"""Turns one row of logits per request into that request's next token (vLLM/OpenAI sampling semantics).

Per row: logprobs of the raw logits, min_tokens masking, the structured output's token mask, penalties, then greedy
argmax or temperature -> top_k -> top_p -> min_p -> sampling by an exponential race, argmax(probs / q) with q ~ Exp(1).
Seeded requests draw q only from their own generator, so their tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tokenfleet.engine.request import Request, SamplingParams, TokenLogprob
from tokenfleet.engine.structured import RequestGrammar
from tokenfleet.engine.structured_mask import apply_structured_masks

# Like vLLM, temperatures this small count as greedy: dividing by them would overflow the logits.
_GREEDY_EPS = 1e-5
_NEG_INF = float("-inf")
# top_p first looks for the nucleus among this many most likely tokens (see _top_p_rows).
_TOP_P_CANDIDATES = 1024


class SamplingRow(Protocol):
    """What the processors read of a request: a Request, or a view of one a few tokens further on (the rows of a
    speculative verification, see engine/rejection.py)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def grammar(self) -> RequestGrammar | None: ...

    @property
    def generator(self) -> torch.Generator | None: ...


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None where params.logprobs is None


@dataclass
class _Plan:
    """Batch rows grouped by how much work they need."""

    plain_greedy: list[int] = field(default_factory=list)  # argmax of the raw logits, nothing else
    processed: list[int] = field(default_factory=list)  # penalties, min_tokens, a structured output or sampling
    with_logprobs: list[int] = field(default_factory=list)


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _GREEDY_EPS


def _min_tokens_active(req: SamplingRow) -> bool:
    return req.num_output_tokens < req.params.min_tokens


def is_plain_greedy(row: SamplingRow) -> bool:
    """Its token is the argmax of the raw logits: greedy, and nothing changes the logits first."""
    params = row.params
    return is_greedy(params) and not params.has_penalties and not _min_tokens_active(row) and row.grammar is None


def _make_plan(requests: Sequence[SamplingRow]) -> _Plan:
    plan = _Plan()
    for i, req in enumerate(requests):
        if req.params.logprobs is not None:
            plan.with_logprobs.append(i)
        (plan.plain_greedy if is_plain_greedy(req) else plan.processed).append(i)
    return plan


def _index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """Per-row scalars as an [n, 1] tensor that broadcasts over the vocab."""
    return _per_row(values, like).unsqueeze(1)


def _per_row(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def _apply_to_rows(x: torch.Tensor, rows: Sequence[int], fn: Callable[[torch.Tensor], None]) -> None:
    """Run the in-place `fn` on just `rows` of x (gathered, then written back), or on x itself if all rows."""
    if len(rows) == x.shape[0]:
        fn(x)
        return
    idx = _index(rows, x.device)
    sub = x.index_select(0, idx)
    fn(sub)
    x.index_copy_(0, idx, sub)


def _pair_keys(seqs: Sequence[tuple[int, torch.Tensor]], vocab: int, device: torch.device) -> torch.Tensor:
    """row * vocab + token for every (row, token ids) pair, dropping ids outside the vocab."""
    rows = torch.tensor([row for row, _ in seqs], dtype=torch.long)
    lengths = torch.tensor([len(tokens) for _, tokens in seqs], dtype=torch.long)
    tokens = torch.cat([tokens for _, tokens in seqs])
    keys = torch.repeat_interleave(rows, lengths) * vocab + tokens
    return keys[(tokens >= 0) & (tokens < vocab)].to(device)


def _ids(tokens: Sequence[int]) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long)


class PromptTokenCache:
    """Each live request's distinct prompt token ids as a CPU tensor. Prompts never change, so the
    repetition penalty converts them once per request instead of once per step."""

    def __init__(self) -> None:
        self._by_request: weakref.WeakKeyDictionary[SamplingRow, torch.Tensor] = weakref.WeakKeyDictionary()

    def __call__(self, req: SamplingRow) -> torch.Tensor:
        ids = self._by_request.get(req)
        if ids is None:
            ids = self._by_request[req] = _ids(sorted(set(req.prompt_token_ids)))
        return ids


def _unique(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct keys and their counts. (torch.unique(sorted=True) is ~100x slower than this on CPU.)"""
    uniques, counts = torch.unique_consecutive(keys.sort().values, return_counts=True)  # torch types it Any
    return uniques, counts


def _split_keys(keys: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    return keys // vocab, keys % vocab


def apply_min_tokens(x: torch.Tensor, requests: Sequence[SamplingRow], eos_token_ids: frozenset[int]) -> None:
    """In place: before min_tokens outputs exist, a request may not emit eos or any of its stop_token_ids."""
    vocab = x.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, req in enumerate(requests):
        if not _min_tokens_active(req):
            continue
        # As in vLLM, eos only counts as a stop token when it is not ignored.
        stops = set(req.params.stop_token_ids or ())
        if not req.params.ignore_eos:
            stops |= eos_token_ids
        banned = [t for t in stops if 0 <= t < vocab]
        rows.extend([i] * len(banned))
        cols.extend(banned)
    if rows:
        x[_index(rows, x.device), _index(cols, x.device)] = _NEG_INF


def _repetition_penalty(
    x: torch.Tensor,
    requests: Sequence[SamplingRow],
    rows: list[int],
    outputs: dict[int, torch.Tensor],
    prompts: Callable[[SamplingRow], torch.Tensor],
) -> None:
    vocab = x.shape[1]
    seqs = [(i, prompts(requests[i])) for i in rows] + [(i, outputs[i]) for i in rows]
    keys, _ = _unique(_pair_keys(seqs, vocab, x.device))
    r, c = _split_keys(keys, vocab)
    penalty = _per_row([req.params.repetition_penalty for req in requests], x)[r]
    vals = x[r, c]
    x[r, c] = torch.where(vals > 0, vals / penalty, vals * penalty)


def _frequency_presence_penalty(
    x: torch.Tensor, requests: Sequence[SamplingRow], rows: list[int], outputs: dict[int, torch.Tensor]
) -> None:
    vocab = x.shape[1]
    keys, counts = _unique(_pair_keys([(i, outputs[i]) for i in rows], vocab, x.device))
    r, c = _split_keys(keys, vocab)
    frequency = _per_row([req.params.frequency_penalty for req in requests], x)[r]
    presence = _per_row([req.params.presence_penalty for req in requests], x)[r]
    x[r, c] -= frequency * counts.to(x.dtype) + presence


def apply_penalties(
    x: torch.Tensor, requests: Sequence[SamplingRow], prompts: Callable[[SamplingRow], torch.Tensor] | None = None
) -> None:
    """In place: repetition (prompt + output tokens), then frequency and presence (output tokens) penalties.

    Only the (row, token) pairs that occur are touched, so the cost is the number of tokens, not rows x vocab.
    `prompts` gives a request's prompt token ids as a tensor (e.g. a PromptTokenCache).
    """
    rows = [i for i, r in enumerate(requests) if r.params.has_penalties]
    outputs = {i: _ids(requests[i].output_token_ids) for i in rows}
    repetition = [i for i in rows if requests[i].params.repetition_penalty != 1.0]
    if repetition:
        _repetition_penalty(x, requests, repetition, outputs, prompts or (lambda req: _ids(req.prompt_token_ids)))
    additive = [i for i in rows if requests[i].params.frequency_penalty or requests[i].params.presence_penalty]
    if additive:
        _frequency_presence_penalty(x, requests, additive, outputs)


def _top_k_rows(x: torch.Tensor, ks: Sequence[int]) -> None:
    top = x.topk(max(ks), dim=-1).values
    kth = top.gather(1, torch.tensor(ks, dtype=torch.long, device=x.device).unsqueeze(1) - 1)
    # Ties with the k-th value are kept, as with vLLM's sort-based top-k.
    x.masked_fill_(x < kth, _NEG_INF)


def apply_top_k(x: torch.Tensor, top_ks: Sequence[int]) -> None:
    """In place: keep each row's top_k largest logits; 0 (or >= vocab) means disabled."""
    vocab = x.shape[1]
    rows = [i for i, k in enumerate(top_ks) if 0 < k < vocab]
    if rows:
        _apply_to_rows(x, rows, lambda s: _top_k_rows(s, [top_ks[i] for i in rows]))


def _nucleus_floor(desc_probs: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From a descending prefix of each row's probs: the smallest prob inside the nucleus ([m, 1]) and
    whether the prefix was long enough to contain the whole nucleus ([m])."""
    cum = desc_probs.cumsum(dim=-1)
    # A token is kept while the mass strictly before it is < top_p: the smallest prefix reaching top_p.
    # The top token is always kept, also when top_p underflows to 0 in the probs' dtype (e.g. 1e-50).
    n_keep = ((cum - desc_probs) < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)
    return desc_probs.gather(1, n_keep - 1), cum[:, -1] >= top_p.squeeze(1)


def _top_p_rows(x: torch.Tensor, ps: Sequence[float]) -> None:
    probs = x.softmax(dim=-1)
    top_p = _column(ps, probs)
    # Nuclei are usually far smaller than the vocab: look for them among the top candidates and sort
    # the whole row only where the candidates' mass falls short of top_p. Both give the same floor.
    candidates = probs.topk(min(_TOP_P_CANDIDATES, probs.shape[1]), dim=-1).values
    floor, covered = _nucleus_floor(candidates, top_p)
    short = [i for i, ok in enumerate(covered.tolist()) if not ok]
    if short:
        idx = _index(short, x.device)
        full = probs.index_select(0, idx).sort(dim=-1, descending=True).values
        floor.index_copy_(0, idx, _nucleus_floor(full, top_p.index_select(0, idx))[0])
    x.masked_fill_(probs < floor, _NEG_INF)


def apply_top_p(x: torch.Tensor, top_ps: Sequence[float]) -> None:
    """In place: keep the smallest set of most likely tokens whose probability reaches top_p."""
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if rows:
        _apply_to_rows(x, rows, lambda s: _top_p_rows(s, [top_ps[i] for i in rows]))


def apply_min_p(x: torch.Tensor, min_ps: Sequence[float]) -> None:
    """In place: drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    rows = [i for i, m in enumerate(min_ps) if m > 0.0]

    def drop(s: torch.Tensor) -> None:
        floor = s.amax(dim=-1, keepdim=True) + _column([math.log(min_ps[i]) for i in rows], s)
        s.masked_fill_(s < floor, _NEG_INF)

    if rows:
        _apply_to_rows(x, rows, drop)


def _uniform_noise(
    generators: Sequence[torch.Generator | None], shape: torch.Size, device: torch.device
) -> torch.Tensor:
    """U[0, 1) of `shape`; a row with a generator draws exactly one vocab-sized vector from it (on CPU,
    where request generators live), so its values do not depend on the rest of the batch."""
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if not seeded:
        return torch.rand(shape, device=device)
    own = torch.empty((len(seeded), shape[1]))
    for j, i in enumerate(seeded):
        own[j].uniform_(generator=generators[i])
    if len(seeded) == shape[0]:
        return own.to(device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    u = torch.empty(shape, device=device)
    u.index_copy_(0, _index(seeded, device), own.to(device))
    u.index_copy_(0, _index(unseeded, device), torch.rand((len(unseeded), shape[1]), device=device))
    return u


def _random_probs(x: torch.Tensor, requests: Sequence[SamplingRow]) -> torch.Tensor:
    """The distribution each random row samples from: temperature, top_k, top_p, min_p, softmax (x in place)."""
    params = [r.params for r in requests]
    temps = [p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        x.div_(_column(temps, x))
    apply_top_k(x, [p.top_k for p in params])
    apply_top_p(x, [p.top_p for p in params])
    apply_min_p(x, [p.min_p for p in params])
    return x.softmax(dim=-1)


def sample_from(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One draw per row of `probs` (modified in place), a row with a generator drawing only from it."""
    # Exponential race: with q ~ Exp(1), argmax(probs / q) is a draw from probs. q = -log(U) is never 0
    # (so masked tokens never give 0/0 = NaN) and is several times cheaper than exponential_() on CPU.
    q = _uniform_noise(generators, probs.shape, probs.device).log_().neg_()
    return probs.div_(q).argmax(dim=-1)


def _sample_random(x: torch.Tensor, requests: Sequence[SamplingRow]) -> torch.Tensor:
    return sample_from(_random_probs(x, requests), [r.generator for r in requests])


class Sampler:
    """Picks the next token for every request in a batch from its row of logits."""

    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self._prompts = PromptTokenCache()

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"expected logits of shape [{len(requests)}, vocab], got {tuple(logits.shape)}")
        plan = _make_plan(requests)
        if not plan.processed and not plan.with_logprobs:
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(requests))
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        if plan.plain_greedy:
            idx = _index(plan.plain_greedy, logits.device)
            tokens.index_copy_(0, idx, logits.index_select(0, idx).argmax(dim=-1))
        if plan.processed:
            idx = _index(plan.processed, logits.device)
            # index_select copies, so the caller's logits are never modified.
            rows = logits.index_select(0, idx).float()
            tokens.index_copy_(0, idx, self._process_and_sample(rows, [requests[i] for i in plan.processed]))
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, collect_logprobs(logits, requests, plan.with_logprobs, token_ids))

    def probabilities(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """[rows, vocab] float32: the distribution each row's token is drawn from, after every processor that
        sampling applies (a greedy row's is one-hot at its argmax). For rows without a structured output (those
        that speculate): the caller's logits are never modified."""
        if any(row.grammar is not None for row in rows):
            raise ValueError("structured outputs are sampled with their token masks, not from probabilities")
        x = logits.to(torch.float32, copy=True)
        apply_min_tokens(x, rows, self.eos_token_ids)
        apply_penalties(x, rows, self._prompts)
        greedy = [i for i, row in enumerate(rows) if is_greedy(row.params)]
        random = [i for i, row in enumerate(rows) if not is_greedy(row.params)]
        probs = torch.zeros_like(x) if greedy else x
        if greedy:
            idx = _index(greedy, x.device)
            probs[idx, x.index_select(0, idx).argmax(dim=-1)] = 1.0
        if random and greedy:
            idx = _index(random, x.device)
            probs.index_copy_(0, idx, _random_probs(x.index_select(0, idx), [rows[i] for i in random]))
        elif random:
            probs = _random_probs(x, rows)
        return probs

    def _process_and_sample(self, x: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """x: float32 rows owned by the sampler, modified in place. Returns one token id per row."""
        apply_min_tokens(x, requests, self.eos_token_ids)
        apply_structured_masks(x, [_caught_up_grammar(r) for r in requests])
        apply_penalties(x, requests, self._prompts)
        greedy = [i for i, r in enumerate(requests) if is_greedy(r.params)]
        if len(greedy) == len(requests):
            return x.argmax(dim=-1)
        random = [i for i, r in enumerate(requests) if not is_greedy(r.params)]
        if not greedy:
            return _sample_random(x, requests)
        out = torch.empty(len(requests), dtype=torch.long, device=x.device)
        g_idx, r_idx = _index(greedy, x.device), _index(random, x.device)
        out.index_copy_(0, g_idx, x.index_select(0, g_idx).argmax(dim=-1))
        out.index_copy_(0, r_idx, _sample_random(x.index_select(0, r_idx), [requests[i] for i in random]))
        return out


def _caught_up_grammar(req: Request) -> RequestGrammar | None:
    """The request's matcher, at the end of its output so far (see RequestGrammar.catch_up)."""
    grammar = req.grammar
    if grammar is not None and grammar.num_consumed != req.num_output_tokens:
        grammar.catch_up(req.output_token_ids)
    return grammar


def collect_logprobs(
    logits: torch.Tensor, requests: Sequence[SamplingRow], rows: list[int], token_ids: list[int]
) -> list[TokenLogprob | None]:
    """Logprobs of the raw (unprocessed) logits: the sampled token's and the top-n alternatives."""
    result: list[TokenLogprob | None] = [None] * len(requests)
    if not rows:
        return result
    device = logits.device
    lsm = torch.log_softmax(logits.index_select(0, _index(rows, device)).float(), dim=-1)
    sampled_ids = [token_ids[i] for i in rows]
    sampled = lsm.gather(1, _index(sampled_ids, device).unsqueeze(1)).squeeze(1).tolist()
    counts = [min(requests[i].params.logprobs or 0, lsm.shape[1]) for i in rows]
    top_vals: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if max(counts) > 0:
        vals, ids = lsm.topk(max(counts), dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        n = counts[j]
        result[i] = TokenLogprob(
            token_id=sampled_ids[j], logprob=sampled[j], top=list(zip(top_ids[j][:n], top_vals[j][:n]))
        )
    return result
