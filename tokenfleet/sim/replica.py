"""One simulated replica: the engine's real Scheduler and KVBlockManager step by step, the forward pass replaced by
the cost model's duration, and the tokens taken from the request's predetermined answer.

Every step follows Engine.step(): schedule -> (the cost model instead of the model) -> update -> append the
sampled tokens -> finish. The engine's decisions are the real code's. What this file adds is speed:

Parked decodes. A running request in steady decode gets exactly one token per step, and the only things it does to
the block manager are taking a block when its next token starts one and registering a block in the prefix cache when
it fills one. Such requests are taken out of the scheduler's plan (`Scheduler.park`) and advanced lazily: their
counters are written back only at those block events (on the step and in the order the scheduler would do them),
when they finish, are cancelled, or when a step needs them back (`Scheduler.unpark`). A step's cost is then
proportional to what changes, not to the batch. Parked requests rejoin the scheduler (a full step) whenever the
scheduler's choices could involve them: the token budget or blocks may run short (so it might preempt), or a queued
request of a higher class might need room that only preempting them could make. The result is the same as running
every step in full, up to which free block each request receives within one step (tests/sim check results are
identical both ways).

Runs of parked steps. When a step has only parked decodes and nothing queued or running besides them, the steps
that follow are the same kind until a parked request finishes, a step's block takes could outrun the free blocks,
or something arrives from outside (a request, a cancellation). Their durations are then known in advance, so the
replica schedules one event for the whole run instead of one per step; each step's block takes, prefix-cache
registrations, step counters and inter-token gap are applied, in step order and at the step's own time, when
something looks (report(), steps, busy_s) or when the run ends. An arrival or a cancellation during a run cuts it
at the step in progress, which ends as it would have, so the result is the same as stepping one by one.

The engine is driven only through its verbs (Scheduler: add, schedule, update, finish, park, unpark;
KVBlockManager: take_blocks, mark_computed; Request: append_token(s)); this file writes none of their fields
(tests/sim/test_engine_interface.py). Its own record of a request is the SimRequest in `sims`.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from dataclasses import dataclass
from typing import Protocol

from tokenfleet.engine.kv_blocks import KVBlockManager
from tokenfleet.engine.request import Request, SamplingParams
from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tokenfleet.router.policy import ReplicaState
from tokenfleet.sim.cost_model import CostModel, StepBatch
from tokenfleet.sim.events import EventQueue
from tokenfleet.sim.request import SimRequest


@dataclass
class ReplicaSpec:
    num_blocks: int
    block_size: int = 16
    num_host_blocks: int = 0
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    max_model_len: int = 8192
    scheduler: SchedulerConfig = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.scheduler is None:
            self.scheduler = SchedulerConfig()


class ReplicaSink(Protocol):
    """Where a replica reports what its requests did."""

    def first_token(self, sreq: SimRequest, now: float) -> None: ...

    def finished(self, sreq: SimRequest, now: float, reason: str) -> None: ...

    def inter_token(self, tier: str, gap_s: float, count: int) -> None: ...

    def inter_tokens(self, gap_s: float, per_tier: dict[str, int]) -> None:
        """One step's gap for every parked decode: count per tier."""

    # optional: inter_token_gaps(gaps_s: list[float], ends: list[float], per_tier: dict[str, int]) -> None
    # several steps' gaps at once (a run of parked steps), step i ending at simulated time ends[i]; a sink
    # without it gets inter_tokens once per step, with the clock at the step's end


@dataclass(eq=False, slots=True)
class _Parked:
    req: Request
    sreq: SimRequest
    base_tokens: int  # the request's tokens after step base_step (its last computed token is base_tokens - 2)
    base_step: int
    last_step: int  # the step that samples its last token
    rank: tuple[int, float] = (0, 0.0)  # the scheduler's order: (priority class, arrival)

    def position(self, step: int) -> int:
        """Index of the token the request computes in `step`."""
        return self.base_tokens + step - self.base_step - 2


_rank = operator.attrgetter("rank")
# A run's step durations are computed when it starts, and an arrival at the replica cuts it (every few dozen steps
# on a busy fleet): planning further ahead would mostly compute durations that are thrown away.
RUN_STEPS = 64


@dataclass(eq=False, slots=True)
class _Run:
    """Steps first..last of parked decodes only, scheduled as one event (see the module's docstring)."""

    first: int
    last: int
    starts: list[float]  # starts[k - first]: when step k begins; starts[-1]: when the last one ends
    durations: list[float]
    begun: int = 0  # steps up to this one have had their start applied (takes, counters)
    ended: int = 0  # ... and up to this one their end (registrations, inter-token gap)
    generation: int = 0

    def step_at(self, now: float) -> int:
        """The step in progress at `now` (a step ending exactly now has ended)."""
        return min(self.first + bisect.bisect_right(self.starts, now) - 1, self.last)


class SimReplica:
    def __init__(
        self, name: str, spec: ReplicaSpec, cost: CostModel, events: EventQueue, sink: ReplicaSink, fast: bool = True
    ) -> None:
        self.name, self.spec, self.cost, self.events, self.sink, self.fast = name, spec, cost, events, sink, fast
        self._blocks = KVBlockManager(
            spec.num_blocks, spec.block_size, spec.num_host_blocks, spec.watermark, spec.enable_prefix_caching
        )
        self.base = spec.scheduler
        self.scheduler = Scheduler(self.base, self._blocks)
        self.state = ReplicaState(name)
        self.step_no = 0
        self.busy = False
        self._busy_s = 0.0
        self._steps = 0
        self.full_steps = 0
        self.runs = True  # runs of parked steps as one event (fast only)
        self._run: _Run | None = None
        self._generation = 0
        self._gaps_sink = getattr(sink, "inter_token_gaps", None)
        events.stop_hooks.append(self.sync)  # a run in progress when the simulation stops is applied up to then
        self.sims: dict[Request, SimRequest] = {}  # the engine's requests here, until they end
        self.parked: dict[Request, _Parked] = {}
        self.parked_by_class: dict[int, dict[Request, _Parked]] = {}
        self.parked_per_tier: dict[str, int] = {}
        self._position_sum_base = 0  # sum over parked of (base_tokens - base_step - 2): positions = this + n*step
        # a parked request takes a block every block_size steps, and registers one the step before: buckets by
        # step modulo block_size; and the step each will sample its last token
        self._takes: list[dict[Request, _Parked]] = [{} for _ in range(spec.block_size)]
        self._registers: list[dict[Request, _Parked]] = [{} for _ in range(spec.block_size)]
        self._finishes: dict[int, list[_Parked]] = {}
        self._params: dict[int, SamplingParams] = {}
        self._aborts: list[SimRequest] = []
        self._step: tuple[int, SchedulerOutput, list, float] | None = None

    # --- requests in and out ------------------------------------------------------------------------------

    def add_many(self, sreqs: list[SimRequest]) -> None:
        """Queues several requests before the next step starts (an offline batch)."""
        busy, self.busy = self.busy, True
        for sreq in sreqs:
            self.add(sreq)
        self.busy = busy
        if not busy:
            self._begin_step()

    def add(self, sreq: SimRequest) -> None:
        params = self._params.get(sreq.max_tokens)  # the engine never changes a request's params: share them
        if params is None:
            params = self._params[sreq.max_tokens] = SamplingParams(
                max_tokens=sreq.max_tokens, ignore_eos=True, detokenize=False
            )
        # the keys are known (the answer is predetermined): the engine does not hash the tokens again
        req = Request(
            sreq.rid, sreq.prompt, params, priority=sreq.priority, arrival_time=sreq.arrival, block_hashes=sreq.hashes
        )
        self.sims[req] = sreq
        sreq.req, sreq.replica = req, self.name
        if self._run is not None:
            self._cut_run()
        self.scheduler.add(req)
        if not self.busy:
            self._begin_step()

    def abort(self, sreq: SimRequest) -> None:
        """Cancels between steps, as the async engine does."""
        if self._run is not None:
            self._cut_run()
        if self.busy:
            self._aborts.append(sreq)
        else:
            self._apply_abort(sreq)

    def _apply_abort(self, sreq: SimRequest) -> None:
        req = sreq.req
        if req is None or req.is_finished:
            return
        if req in self.parked:
            self._unpark(self.parked[req])
        self._done(req, "abort", self.events.clock.now)

    def has_work(self) -> bool:
        return bool(self.parked) or self.scheduler.has_work()

    @property
    def blocks(self) -> KVBlockManager:
        """The block manager, for code outside the replica (a KV transfer, a test): a run in progress is cut at the
        step in progress first, so the caller sees and changes the state between two steps, as step by step."""
        if self._run is not None:
            self._cut_run()
        return self._blocks

    @property
    def steps(self) -> int:
        """Engine steps begun so far."""
        self.sync()
        return self._steps

    @property
    def busy_s(self) -> float:
        """Simulated seconds of the steps begun so far."""
        self.sync()
        return self._busy_s

    def report(self) -> ReplicaState:
        """The load report the router reads (what GET /load returns), into self.state."""
        self.sync()
        state, sched = self.state, self.scheduler
        state.running = len(sched.running) + len(self.parked)
        state.waiting = len(sched.queue)
        state.queued_tokens = sum(r.num_uncomputed_tokens for r in sched.queue) + sum(
            r.num_uncomputed_tokens for r in sched.running if r.num_uncomputed_tokens > 1
        )
        state.kv_usage = self._blocks.usage()
        return state

    # --- one step -----------------------------------------------------------------------------------------

    def _begin_step(self) -> None:
        s = self.step_no + 1
        if self.parked:
            takes = self._takes[s % self.spec.block_size]
            if self._needs_full_step(len(takes)):
                self._unpark_all()
            else:
                self._unpark_classes_at_risk(len(takes))
            self._take_blocks(s)
        out = self._schedule()
        if out.chunks or out.swap_in or out.swap_out or not self.parked:
            duration = self.cost.step_time(self._batch(out, s))
        else:  # only parked decodes: the same arithmetic without building the batch
            duration = self._parked_step_time(s)
            if self.runs and not self.scheduler.has_work() and self._begin_run(s, duration):
                return
        sampling = [c for c in out.chunks if c.samples] if out.chunks else out.chunks
        self._step = (s, out, sampling, duration)
        self.busy = True
        self._steps += 1
        self._busy_s += duration
        self.events.after(duration, self._end_step)

    def _take_blocks(self, step: int) -> None:
        """The blocks parked requests start in `step` (which free block each gets does not matter: results are
        the same up to block relabelling)."""
        takes = self._takes[step % self.spec.block_size]
        if takes:
            self._blocks.take_blocks(takes)

    def _register_blocks(self, step: int) -> None:
        """The blocks parked requests fill in `step`, registered in the prefix cache in the scheduler's order (the
        first to register a key wins, should two blocks share it)."""
        registers = self._registers[step % self.spec.block_size]
        if registers:
            mark_computed, offset = self._blocks.mark_computed, step - 1
            for p in registers.values():
                mark_computed(p.req, p.base_tokens + offset - p.base_step)

    def _parked_step_time(self, step: int) -> float:
        n = len(self.parked)
        return self.cost.decode_time(n, self._position_sum_base + n * step + n)

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler
        if not sched.running and not sched.queue:
            return SchedulerOutput()
        return sched.schedule()

    def _batch(self, out: SchedulerOutput, step: int) -> StepBatch:
        batch = StepBatch(swapped_blocks=len(out.swap_in) + len(out.swap_out))
        for chunk in out.chunks:
            batch.add_chunk(chunk.req.num_computed_tokens, chunk.num_tokens)
        n = len(self.parked)
        if n:
            contexts = self._position_sum_base + n * step + n  # tokens each parked decode attends to, summed
            batch.sequences += n
            batch.decode_sequences += n
            batch.attention_pairs += contexts
            batch.kv_tokens_read += contexts
            batch.decode_context += contexts - n
        return batch

    def _end_step(self) -> None:
        s, out, sampling, duration = self._step
        now = self.events.clock.now
        self._register_blocks(s)
        self.scheduler.update(out)
        if self.parked:
            self.sink.inter_tokens(duration, self.parked_per_tier)
        for chunk in sampling:
            self._sample(chunk.req, now)
        finishes = self._finishes.pop(s, None)
        if finishes:
            for p in sorted(finishes, key=_rank):
                if self.parked.get(p.req) is p:
                    self._finish_parked(p, s, now)
        self.step_no, self._step = s, None
        for sreq in self._aborts:  # still busy: what these free may bring new requests, queued for the next step
            self._apply_abort(sreq)
        self._aborts.clear()
        if self.fast:
            self._park_decodes(now)
        self.busy = False
        if self.has_work():
            self._begin_step()

    def _sample(self, req: Request, now: float) -> None:
        if req.is_finished:  # cancelled during the step? (aborts apply after it) - never sampled twice
            return
        sreq = self.sims[req]
        req.append_token(sreq.output[req.num_output_tokens])
        if sreq.first_token is None:
            sreq.first_token = now
            self.sink.first_token(sreq, now)
        else:
            self.sink.inter_token(sreq.tier, now - sreq.last_token, 1)
        sreq.last_token = now
        if req.num_output_tokens >= sreq.max_tokens:
            self._done(req, "length", now)

    def _done(self, req: Request, reason: str, now: float) -> None:
        self.scheduler.finish(req, reason)
        sreq = self.sims.pop(req)
        sreq.tokens_out, sreq.preemptions = req.num_output_tokens, req.num_preemptions
        sreq.cached_tokens = max(req.num_cached_tokens, 0)
        self.sink.finished(sreq, now, reason)

    # --- runs of parked steps ------------------------------------------------------------------------------

    def _begin_run(self, step: int, duration: float) -> bool:
        """Step `step` has only parked decodes and nothing else to do: it and the steps like it that follow are
        scheduled as one event. False when no step would follow (the step then runs on its own)."""
        last = self._run_end(step)
        if last == step:
            return False
        n = len(self.parked)
        durations = [duration] + self.cost.decode_times(n, self._position_sum_base + n * (step + 1) + n, n, last - step)
        starts = list(itertools.accumulate(durations, initial=self.events.clock.now))  # as events one by one
        self._generation += 1
        self._run = _Run(step, last, starts, durations, step, step - 1, self._generation)
        self.busy = True
        self._steps += 1
        self._busy_s += duration
        self.events.at(starts[-1], self._end_run, self._generation)
        return True

    def _run_end(self, step: int) -> int:
        """The run's last step: the first parked request's last token, or the step before one whose block takes
        could find too few free blocks (the scheduler might preempt then: that step runs in full), and at most
        RUN_STEPS steps on (the next run goes on from there exactly as this one would have)."""
        finish = min(min(self._finishes), step + RUN_STEPS)
        counts = [len(takes) for takes in self._takes]
        bs, free = self.spec.block_size, self._blocks.num_free_blocks
        if sum(counts) * -(-(finish - step) // bs) <= free:  # enough for every step's takes, counted by whole cycles
            return finish
        for k in range(step + 1, finish + 1):
            need = counts[k % bs]
            if need > free:
                return k - 1
            free -= need
        return finish

    def sync(self) -> None:
        """Applies what the current run's steps did by now (a no-op outside a run)."""
        run = self._run
        if run is not None:
            self._advance(run, run.step_at(self.events.clock.now))

    def _advance(self, run: _Run, current: int) -> None:
        """Applies the run's steps before `current` and the start of `current`, in step order."""
        first = run.ended + 1
        registers, bs = self._registers, self.spec.block_size
        for k in range(first, current):
            if k > run.begun:
                self._start_run_step(run, k)
            if registers[k % bs]:
                self._register_blocks(k)
        if current > first:
            self._report_gaps(run, first, current)
            self.step_no = run.ended = current - 1
        if current > run.begun:
            self._start_run_step(run, current)

    def _start_run_step(self, run: _Run, step: int) -> None:
        self._take_blocks(step)
        self._steps += 1
        self._busy_s += run.durations[step - run.first]
        run.begun = step

    def _report_gaps(self, run: _Run, first: int, end: int) -> None:
        """The inter-token gaps of the run's steps first .. end - 1, for every parked decode."""
        i, j = first - run.first, end - run.first
        if self._gaps_sink is not None:
            self._gaps_sink(run.durations[i:j], run.starts[i + 1 : j + 1], self.parked_per_tier)
            return
        clock = self.events.clock
        now = clock.now
        for k in range(i, j):  # one call per step, the sink seeing the time it would have seen
            clock.now = run.starts[k + 1]
            self.sink.inter_tokens(run.durations[k], self.parked_per_tier)
        clock.now = now

    def _cut_run(self) -> None:
        """Something arrives: the run ends with the step in progress (the next step begins as usual)."""
        run = self._run
        current = run.step_at(self.events.clock.now)
        self._advance(run, current)
        if current < run.last:
            keep = current - run.first + 1
            del run.durations[keep:], run.starts[keep + 1 :]
            run.last = current
            self._generation += 1
            run.generation = self._generation
            self.events.at(run.starts[-1], self._end_run, run.generation)

    def _end_run(self, generation: int) -> None:
        run = self._run
        if run is None or run.generation != generation:  # a run cut short: its first end event is void
            return
        self._advance(run, run.last)
        self._run = None
        self._step = (run.last, SchedulerOutput(), [], run.durations[-1])
        self._end_step()

    # --- parked decodes -----------------------------------------------------------------------------------

    def _needs_full_step(self, takes: int) -> bool:
        """Whether the scheduler's choices this step could involve parked requests (budget or blocks short)."""
        sched, budget = self.scheduler, self.base.max_num_batched_tokens
        if not sched.running:
            return len(self.parked) > budget or takes > self._blocks.num_free_blocks
        decodes = sum(1 for r in sched.running if r.num_uncomputed_tokens == 1)
        if len(self.parked) + decodes > budget:
            return True
        return takes + self._running_block_needs() > self._blocks.num_free_blocks

    def _running_block_needs(self) -> int:
        budget, blocks = self.base.max_num_batched_tokens, self._blocks
        return sum(blocks.blocks_needed(r, min(r.num_uncomputed_tokens, budget)) for r in self.scheduler.running)

    def _unpark_classes_at_risk(self, takes: int) -> None:
        """A queued request may preempt running work of a strictly lower class when it cannot be admitted: if the
        queue might not all fit, parked requests of such classes rejoin the scheduler for this step."""
        queue = self.scheduler.queue
        if not queue:
            return
        at_risk = [c for c, group in self.parked_by_class.items() if group and c > queue[0].priority]
        if not at_risk:
            return
        blocks = self._blocks
        need = takes + self._running_block_needs() + sum(blocks.blocks_for(r.num_tokens) for r in queue)
        seqs = len(self.scheduler.running) + len(self.parked) + len(queue)
        if need <= blocks.num_free_blocks - blocks.watermark_blocks and seqs <= self.base.max_num_seqs:
            return
        for c in at_risk:
            for p in list(self.parked_by_class[c].values()):
                self._unpark(p)

    def _park_decodes(self, now: float) -> None:
        sched, sims = self.scheduler, self.sims
        if not any(r.num_uncomputed_tokens == 1 for r in sched.running):
            return

        def steady(req: Request) -> bool:
            # only requests that sampled in the step just ended: one that reached its last prompt token by a
            # prefill chunk has its first token (or, recomputing, a token after a stall) still to report
            sreq = sims[req]
            return req.num_uncomputed_tokens == 1 and sreq.last_token == now and req.num_output_tokens < sreq.max_tokens

        for req in sched.park(steady):
            self._park(req)

    def _park(self, req: Request) -> None:
        s, bs, sreq = self.step_no, self._blocks.block_size, self.sims[req]
        tokens = req.num_tokens
        p = _Parked(req, sreq, tokens, s, s + sreq.max_tokens + req.num_prompt_tokens - tokens, req.rank())
        # While parked, nothing reads its token count (it is in no scheduler list): hold the whole answer now, so
        # the block manager finds any block's tokens; _unpark cuts it back to the tokens generated by then.
        req.append_tokens(sreq.output[tokens - req.num_prompt_tokens : sreq.max_tokens])
        self.parked[req] = p
        self.parked_by_class.setdefault(req.priority, {})[req] = p
        self.parked_per_tier[sreq.tier] = self.parked_per_tier.get(sreq.tier, 0) + 1
        self._position_sum_base += tokens - s - 2
        self._takes[(s + 2 - tokens) % bs][req] = p  # steps that compute a token at index k x block_size
        self._add_register(self._registers[(s + 1 - tokens) % bs], p)  # ... and at index k x block_size - 1
        self._finishes.setdefault(p.last_step, []).append(p)

    @staticmethod
    def _add_register(bucket: dict[Request, _Parked], p: _Parked) -> None:
        """Keeps the bucket in the scheduler's order, ties in the order added (what sorting it stably would give),
        so that registering its blocks needs no sort."""
        last = next(reversed(bucket.values()), None)
        bucket[p.req] = p
        if last is not None and p.rank < last.rank:
            ordered = sorted(bucket.values(), key=_rank)
            bucket.clear()
            bucket.update((q.req, q) for q in ordered)

    def _finish_parked(self, p: _Parked, step: int, now: float) -> None:
        self._unpark(p, step)
        p.sreq.last_token = now
        self._done(p.req, "length", now)

    def _unpark(self, p: _Parked, step: int | None = None) -> None:
        """Writes the request's state after `step` (default: the last finished step) and returns it to the
        scheduler's running list."""
        step = self.step_no if step is None else step
        pos = p.position(step)
        req, sreq = p.req, p.sreq
        del self.parked[req]
        del self.parked_by_class[req.priority][req]
        bs = self.spec.block_size
        del self._takes[(p.base_step + 2 - p.base_tokens) % bs][req]
        del self._registers[(p.base_step + 1 - p.base_tokens) % bs][req]
        self.parked_per_tier[sreq.tier] -= 1
        self._position_sum_base -= p.base_tokens - p.base_step - 2
        sreq.last_token = self.events.clock.now
        self.scheduler.unpark(req, pos + 2)

    def _unpark_all(self) -> None:
        self.full_steps += 1
        for p in list(self.parked.values()):
            self._unpark(p)
