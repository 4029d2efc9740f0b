"""The token masks of a batch's structured rows: each row's matcher fills one row of a bitmask (bit t of the row =
token t allowed), and the sampler keeps only the allowed logits of those rows. Rows without a structured output
are never touched.

The matchers fill their rows one after the other on the engine's thread (each call releases the GIL). llguidance's
thread pool (LLExecutor) was slower at every batch size measured, and its threads spinning beside PyTorch's OpenMP
threads made the next tensor operation up to 100x slower on a 2-core machine.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from tokenfleet.engine.structured import GrammarError, RequestGrammar

_NEG_INF = float("-inf")

if sys.byteorder != "little":  # the bitmask's int32 words are read back as bytes, lowest bit first
    raise ImportError("structured outputs' token masks assume a little-endian machine")


def fill_bitmask(grammars: Sequence[RequestGrammar], words: int) -> torch.Tensor:
    """One int32 row of `words` words per grammar: its next allowed tokens."""
    bitmask = torch.empty((len(grammars), words), dtype=torch.int32)
    row_bytes = words * 4
    pointer = bitmask.data_ptr()
    for i, grammar in enumerate(grammars):
        grammar.check_usable()
        grammar.matcher.unsafe_compute_mask_ptr(pointer + i * row_bytes, row_bytes)
    return bitmask


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bitmask as a bool [rows, vocab_size] tensor (tokens past the mask's end are not allowed)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits).view(torch.bool)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)


def apply_structured_masks(x: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> None:
    """In place: in each row whose grammar is not None, every token the grammar does not allow next gets -inf."""
    rows = [i for i, grammar in enumerate(grammars) if grammar is not None]
    if not rows:
        return
    active = [grammar for grammar in grammars if grammar is not None]
    bitmask = fill_bitmask(active, active[0].mask_words)
    if not bitmask.numpy().any(axis=1).all():
        raise GrammarError("the structured output allows no token here")
    disallowed = allowed_tokens(bitmask, x.shape[1]).logical_not().to(x.device)
    if len(rows) == x.shape[0]:
        x.masked_fill_(disallowed, _NEG_INF)
        return
    idx = torch.tensor(rows, dtype=torch.long, device=x.device)
    sub = x.index_select(0, idx)
    sub.masked_fill_(disallowed, _NEG_INF)
    x.index_copy_(0, idx, sub)
