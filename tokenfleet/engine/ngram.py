"""Prompt-lookup (n-gram) proposals: if the sequence's last n tokens occurred earlier in it (prompt or output), the
tokens that followed that occurrence are proposed as its next ones. It costs no model, and it pays off where an
output copies from its context: extraction, editing, code, summaries that quote, and repetitive generations.

The longest suffix of n tokens (prompt_lookup_max down to prompt_lookup_min) that occurred before wins; among
its occurrences, the latest one followed by a full k tokens, else the one followed by the most.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from tokenfleet.engine.rejection import Proposal
from tokenfleet.engine.request import Request
from tokenfleet.engine.scheduler import ScheduledChunk


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    length = len(tokens)
    if length < 2 or k < 1:
        return []
    # candidate i: an earlier position whose token equals the last one, so tokens[..i] may end like tokens[..-1]
    candidates = np.flatnonzero(tokens[:-1] == tokens[-1])
    if candidates.size == 0:
        return []
    matched = np.ones(candidates.size, dtype=np.int64)
    alive = np.ones(candidates.size, dtype=bool)
    for j in range(1, min(max_n, length - 1)):
        alive &= candidates >= j
        alive[alive] &= tokens[candidates[alive] - j] == tokens[length - 1 - j]
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return []
    ends = candidates[matched == best]
    full = ends[ends + k < length]
    end = int(full[-1]) if full.size else int(ends[0])
    return [int(t) for t in tokens[end + 1 : min(end + 1 + k, length)]]


class TokenArrays:
    """Each request's token ids as a numpy array, extended as the request grows instead of rebuilt each step."""

    def __init__(self) -> None:
        self._arrays: weakref.WeakKeyDictionary[Request, tuple[np.ndarray, int]] = weakref.WeakKeyDictionary()

    def __call__(self, req: Request) -> np.ndarray:
        tokens = req.token_ids
        array, used = self._arrays.get(req, (None, 0))
        if array is None or used > len(tokens):
            array, used = np.empty(max(64, 2 * len(tokens)), dtype=np.int64), 0
        if len(tokens) > len(array):
            array = np.concatenate([array[:used], np.empty(len(tokens), dtype=np.int64)])
        array[used : len(tokens)] = tokens[used:]
        self._arrays[req] = (array, len(tokens))
        return array[: len(tokens)]


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._arrays = TokenArrays()
        self._planned: weakref.WeakKeyDictionary[Request, list[int]] = weakref.WeakKeyDictionary()

    def plan(self, req: Request, limit: int) -> int:
        """Looks the proposals up now (it is cheap), so that the scheduler's budget counts exactly those."""
        tokens = ngram_lookup(self._arrays(req), self.min_n, self.max_n, limit)
        self._planned[req] = tokens
        return len(tokens)

    def propose(self, chunks: Sequence[ScheduledChunk]) -> list[Proposal]:
        return [Proposal(self._planned.pop(c.req)[: c.num_lookahead]) for c in chunks]
