"""Draft-model proposals: a smaller checkpoint with the target's vocabulary proposes k tokens, one forward pass
each, and the target verifies them in one.

The draft keeps a paged KV cache of its own (its layers, heads and dtype) indexed by the target's block ids: a
request's one block table addresses both, so allocation, the lookahead slots, the prefix cache, swapping and
freeing need nothing of their own for the draft, and its memory comes out of the same kv_cache_gib budget.
Recomputing the draft's context every step instead would cost a pass over the whole sequence per proposal.

The draft's cache holds its KV of every token the target computed: it runs the target's prefill chunks in the same
step (so a prefix-cache hit finds the draft's KV in the block too), and each proposal round first catches up on the
tokens verification accepted since the last round (req.num_draft_computed: usually the one token the target added,
two when every proposal was accepted, since the draft never ran its last proposal). Its KV past a rejected
proposal is simply overwritten later, like the target's. One known gap: when every proposal of a request's last
round was accepted, the block holding its final token is cached without the draft's KV of that one token, so a
later prefix hit on it proposes from a slightly wrong draft context there; that lowers acceptance, never
correctness.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenfleet.engine.rejection import Proposal, RowView
from tokenfleet.engine.request import Request
from tokenfleet.engine.runner import attention_layers, copy_blocks, device_cache, host_cache
from tokenfleet.engine.sampler import Sampler, is_greedy, is_plain_greedy, sample_from
from tokenfleet.engine.scheduler import ScheduledChunk, SchedulerOutput
from tokenfleet.engine.step_inputs import DecodeRow, InputBuilder, is_decode
from tokenfleet.model.config import ModelConfig
from tokenfleet.model.cpu_kernels import paged_decode_attention_op
from tokenfleet.model.llama import LlamaForCausalLM


def check_draft_config(draft: ModelConfig, target: ModelConfig, path: str) -> None:
    """Raises ValueError when the draft cannot propose for the target: another vocabulary."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model {path!r} has a vocabulary of {draft.vocab_size} tokens, the target "
            f"{target.vocab_size}: a draft model must share the target's tokenizer and vocabulary"
        )


class DraftModel:
    """The draft model and its paged KV cache."""

    def __init__(self, model: LlamaForCausalLM, block_size: int, device: torch.device) -> None:
        self.model, self.block_size, self.device = model, block_size, device
        self.dtype = next(model.parameters()).dtype
        cfg = model.config
        self.block_shape = (cfg.num_layers, 2, cfg.num_kv_heads, block_size * cfg.head_dim)
        kernel = paged_decode_attention_op() if device.type == "cpu" else None
        for attention in attention_layers(model):
            attention.decode_kernel = kernel
        self.inputs = InputBuilder(block_size, device, self.dtype, uses_kernel=kernel is not None)
        self.kv_cache: torch.Tensor | None = None
        self.num_host_blocks = 0
        self._host_cache: torch.Tensor | None = None

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * self.model.config.kv_bytes_per_token(self.dtype)

    def allocate(self, num_blocks: int, num_host_blocks: int) -> None:
        """A cache of as many blocks as the target's (lazily committed on CPU); swap space at the first swap."""
        self.kv_cache = device_cache(self.block_shape, num_blocks, self.dtype, self.device)
        self.num_host_blocks = num_host_blocks

    @property
    def cache(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("the draft model's KV cache is not allocated yet")
        return self.kv_cache

    @property
    def host_cache(self) -> torch.Tensor:
        if self._host_cache is None:
            self._host_cache = host_cache(self.block_shape, self.num_host_blocks, self.dtype, self.device)
        return self._host_cache

    def swap(self, out: SchedulerOutput) -> None:
        """The same block moves as the target's cache."""
        if out.swap_out:
            copy_blocks(self.cache, self.host_cache, out.swap_out)
        if out.swap_in:
            copy_blocks(self.host_cache, self.cache, out.swap_in)

    def mirror_prefills(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Runs the step's prefill chunks through the draft too, where its KV reaches the chunk's start."""
        prefills = [c for c in chunks if not is_decode(c) and c.req.num_draft_computed == c.req.num_computed_tokens]
        if not prefills:
            return
        inputs = self.inputs.for_chunks(prefills)
        self.model(inputs.input_ids, inputs.positions, self.cache, inputs.meta, inputs.logits_indices[:0])
        for chunk in prefills:
            chunk.req.num_draft_computed = chunk.req.num_computed_tokens + chunk.num_tokens

    def forward(self, rows: Sequence[DecodeRow]) -> torch.Tensor:
        """Logits of every row, in order (each row's KV is written to the draft's cache)."""
        inputs = self.inputs.for_rows(rows)
        logits: torch.Tensor = self.model(
            inputs.input_ids, inputs.positions, self.cache, inputs.meta, inputs.logits_indices
        )
        return logits


class DraftProposer:
    """k proposals per request from the draft model, drawn from its distribution under the request's sampling
    parameters (greedy requests: its argmax), which verification needs as q."""

    def __init__(self, draft: DraftModel, sampler: Sampler) -> None:
        self.draft, self.sampler = draft, sampler

    def plan(self, req: Request, limit: int) -> int:
        return limit

    def propose(self, chunks: Sequence[ScheduledChunk]) -> list[Proposal]:
        rows, last_rows = self._catch_up_rows(chunks)
        logits = self.draft.forward(rows)[last_rows]
        tokens: list[list[int]] = [[] for _ in chunks]
        probs: list[list[torch.Tensor]] = [[] for _ in chunks]
        active = list(range(len(chunks)))  # chunks still proposing, one logits row each
        for j in range(max(c.num_lookahead for c in chunks)):
            views = [RowView(chunks[i].req, tokens[i]) for i in active]
            drawn, q = self._draw(logits, views)
            for row, (i, token) in enumerate(zip(active, drawn)):
                tokens[i].append(token)
                if q is not None:
                    probs[i].append(q[row])
            active = [i for i in active if chunks[i].num_lookahead > j + 1]
            if not active:
                break
            logits = self.draft.forward([self._next_row(chunks[i], tokens[i]) for i in active])
        for chunk, proposed in zip(chunks, tokens):
            # its KV covers the tokens it read: the request's, then every proposal but the last
            chunk.req.num_draft_computed = chunk.req.num_tokens + len(proposed) - 1
        return [self._proposal(c, t, p) for c, t, p in zip(chunks, tokens, probs)]

    def _draw(self, logits: torch.Tensor, views: list[RowView]) -> tuple[list[int], torch.Tensor | None]:
        """One proposal per row and the distributions they were drawn from (None when every row is plain greedy:
        the argmax of the raw logits, a point mass)."""
        if all(is_plain_greedy(view) for view in views):
            return logits.argmax(dim=-1).tolist(), None
        q = self.sampler.probabilities(logits, views)
        return sample_from(q.clone(), [v.generator for v in views]).tolist(), q

    @staticmethod
    def _catch_up_rows(chunks: Sequence[ScheduledChunk]) -> tuple[list[DecodeRow], list[int]]:
        """The first pass: each request's tokens the draft has not read yet (at least its last one); returns the
        rows and, per chunk, the row whose logits give its first proposal."""
        rows: list[DecodeRow] = []
        last_rows = []
        for chunk in chunks:
            req = chunk.req
            start = min(req.num_draft_computed, req.num_tokens - 1)
            rows.extend(DecodeRow(req, req.token_ids[p], p) for p in range(start, req.num_tokens))
            last_rows.append(len(rows) - 1)
        return rows, last_rows

    @staticmethod
    def _next_row(chunk: ScheduledChunk, proposed: list[int]) -> DecodeRow:
        return DecodeRow(chunk.req, proposed[-1], chunk.req.num_tokens + len(proposed) - 1)

    @staticmethod
    def _proposal(chunk: ScheduledChunk, tokens: list[int], probs: list[torch.Tensor]) -> Proposal:
        if is_greedy(chunk.req.params):  # drawn from a point mass: verification needs no q
            return Proposal(tokens)
        return Proposal(tokens, torch.stack(probs))
