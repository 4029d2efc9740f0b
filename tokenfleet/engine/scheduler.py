"""One decision per model step: which tokens of which requests go into the next forward pass.

Order of work: running decodes, then running prefill chunks, then admissions from the queue (swapped and waiting
requests, most important class first, first come first served within a class). Everything shares one token budget
(chunked prefill). When blocks run out, the victim is the lowest class, then the one with the least work done;
a queued request may also preempt running work of a strictly lower class.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenfleet.engine.kv_blocks import KVBlockManager
from tokenfleet.engine.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    swap_threshold_tokens: int = 512  # preempted sequences this long are swapped to host memory, shorter recomputed


@dataclass
class ScheduledChunk:
    req: Request
    num_tokens: int  # tokens computed this step, starting at req.num_computed_tokens (lookahead included)
    # speculative decoding: the last num_lookahead of those tokens are proposals, spec_token_ids (filled in after
    # scheduling), verified in this step; num_rejected of them turned out wrong (set after sampling)
    num_lookahead: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    num_rejected: int = 0

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the request's tokens, so the step yields its next token."""
        return self.req.num_computed_tokens + self.num_tokens - self.num_lookahead == self.req.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


def victim_key(req: Request) -> tuple[int, int, float]:
    """Larger = preempted first: lowest class (largest number), then least work done, then latest arrival."""
    return (req.priority, -req.num_computed_tokens, req.arrival_time)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: KVBlockManager) -> None:
        self.config, self.blocks = config, blocks
        self.queue: list[Request] = []  # waiting and swapped, in rank order
        self.running: list[Request] = []
        self.num_parked = 0  # running requests advanced by the caller, outside the plan (see park)
        self.prefix_cache_queries = 0  # prompt tokens looked up at first admission (cumulative)
        self.prefix_cache_hits = 0  # of those, found in the prefix cache
        self.num_prefill_tokens = 0  # tokens computed in chunks of more than one token (cumulative)
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        bisect.insort(self.queue, req, key=Request.rank)

    def has_work(self) -> bool:
        return bool(self.queue or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens - self.num_parked  # a parked decode takes a token every step
        self.running.sort(key=lambda r: (r.num_uncomputed_tokens > 1, r.rank()))  # decodes, then prefill chunks
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is RequestStatus.RUNNING:  # not preempted earlier in this loop
                budget -= self._schedule_running(req, budget, out)
        while self.queue and budget > 0:
            scheduled = self._admit(self.queue[0], budget, out)
            if not scheduled:
                break
            budget -= scheduled
        return out

    def _schedule_running(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Schedules what fits in the budget of a running request's tokens, and of its speculative lookahead when
        it decodes, preempting to make room; returns the budget used (net)."""
        n = min(req.num_uncomputed_tokens, budget)
        lookahead = self._lookahead(req, n, budget)
        refund = 0
        while self.blocks.blocks_needed(req, n + lookahead) > self.blocks.num_free_blocks:
            victim = max(self.running, key=victim_key)  # never of a higher class than req, which is a candidate
            refund += self._preempt(victim, out)
            if victim is req:
                return -refund
        self.blocks.grow(req, n + lookahead)  # the lookahead's slots too, in one call
        out.chunks.append(ScheduledChunk(req, n + lookahead, lookahead))
        return n + lookahead - refund

    def _lookahead(self, req: Request, n: int, budget: int) -> int:
        """The proposals a decoding request gets verified this step: what the budget leaves room for, and none when
        their blocks are not free (speculation never preempts anyone)."""
        if not req.num_lookahead_tokens or req.num_uncomputed_tokens != 1:
            return 0
        lookahead = min(req.num_lookahead_tokens, budget - n)
        if self.blocks.blocks_needed(req, n + lookahead) > self.blocks.num_free_blocks:
            return 0
        return lookahead

    def _admit(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Moves the head of the queue into the running batch; returns the tokens scheduled (0 if it cannot)."""
        swapped = req.status is RequestStatus.SWAPPED
        while True:
            if len(self.running) + self.num_parked < self.config.max_num_seqs:
                if swapped:
                    n = min(req.num_uncomputed_tokens, budget)
                    if self.blocks.can_admit(len(req.block_table) + self.blocks.blocks_needed(req, n)):
                        break
                else:
                    n = self.blocks.allocate(req, budget)
                    if n:
                        break
            lower = [r for r in self.running if r.priority > req.priority]
            if not lower:
                return 0
            budget += self._preempt(max(lower, key=victim_key), out)
        self.queue.remove(req)
        if swapped:
            out.swap_in += self.blocks.swap_in(req)
            self.blocks.grow(req, n)
        elif req.num_cached_tokens < 0:  # its first admission: what the prefix cache held of its prompt
            req.scheduled_time = time.monotonic()
            req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
            self.prefix_cache_queries += req.num_prompt_tokens
            self.prefix_cache_hits += req.num_cached_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.chunks.append(ScheduledChunk(req, n))
        return n

    def _preempt(self, req: Request, out: SchedulerOutput) -> int:
        """Sends a running request back to the queue, keeping its place; returns the budget it gives back."""
        refund = 0
        for i, chunk in enumerate(out.chunks):
            if chunk.req is req:
                refund = out.chunks.pop(i).num_tokens
                break
        self.running.remove(req)
        if req.num_computed_tokens >= self.config.swap_threshold_tokens and self.blocks.can_swap_out(req):
            out.swap_out += self.blocks.swap_out(req)
            req.status = RequestStatus.SWAPPED
        else:
            self.blocks.free_request(req)
            req.num_computed_tokens = req.num_draft_computed = 0
            req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.add(req)
        return refund

    def update(self, out: SchedulerOutput) -> None:
        """Records that the step computed the scheduled tokens (their KV is now in the cache). Of a chunk that
        verified proposals, only the accepted ones count (never past the tokens the request kept, when a stop cut
        its accepted run short), and the blocks taken for the rejected tail go back."""
        mark_computed = self.blocks.mark_computed
        for chunk in out.chunks:
            req = chunk.req
            computed = req.num_computed_tokens + chunk.num_tokens
            if chunk.num_lookahead:
                mark_computed(req, min(computed - chunk.num_rejected, req.num_tokens))
                self.blocks.trim(req)
            else:
                mark_computed(req, computed)
                if chunk.num_tokens > 1:
                    self.num_prefill_tokens += chunk.num_tokens
                    req.num_prefill_chunks += 1

    def park(self, steady: Callable[[Request], bool]) -> list[Request]:
        """Takes the running requests that `steady` picks out of the plan and returns them, in batch order. A parked
        request keeps its blocks, its place among max_num_seqs and one token of every step's budget, and its caller
        advances it (the fleet simulator prices steady decodes in bulk) until it is unparked."""
        parked: list[Request] = []
        kept: list[Request] = []
        for req in self.running:
            (parked if steady(req) else kept).append(req)
        self.running = kept
        self.num_parked += len(parked)
        return parked

    def unpark(self, req: Request, num_tokens: int) -> None:
        """Returns a parked request to the plan in steady decode with its first `num_tokens` tokens (any appended
        ahead of that are dropped), all but the last computed."""
        del req.token_ids[num_tokens:]
        req.num_computed_tokens = num_tokens - 1
        self.running.append(req)
        self.num_parked -= 1

    def finish(self, req: Request, reason: str) -> None:
        if req.is_finished:
            return
        if req.status is RequestStatus.SWAPPED:
            self.blocks.free_swapped(req)
        else:
            self.blocks.free_request(req)
        (self.running if req.status is RequestStatus.RUNNING else self.queue).remove(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
