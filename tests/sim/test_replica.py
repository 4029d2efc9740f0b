"""The simulated replica makes the engine's decisions: parked decodes change nothing, preemption happens when the
KV cache is short, and on an offline batch it takes the same steps and preempts as often as the real engine."""

from __future__ import annotations

import collections

import pytest

from tests.sim.helpers import make_requests, run_replica
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.engine import Engine
from tokenfleet.engine.request import SamplingParams


def _histogram(gaps):
    counts = collections.Counter()
    for tier, gap, count in gaps:
        counts[(tier, gap)] += count
    return counts


@pytest.mark.parametrize(
    "seed, rate, blocks, host, seqs, budget",
    [
        (0, 20, 400, 200, 32, 512),  # preemption by swap and by recompute
        (1, 40, 300, 0, 64, 256),  # recompute only, three classes competing
        (2, 10, 2000, 0, 256, 2048),  # roomy: no preemption
    ],
)
def test_parked_decodes_give_exactly_the_results_of_full_steps(seed, rate, blocks, host, seqs, budget) -> None:
    runs = []
    for fast in (False, True):
        replica, sink = run_replica(
            make_requests(seed, 250, rate),
            num_blocks=blocks,
            host_blocks=host,
            max_num_seqs=seqs,
            budget=budget,
            fast=fast,
        )
        runs.append((sink.done, _histogram(sink.gaps), replica.steps, replica.scheduler.num_preemptions))
    assert runs[0] == runs[1]
    assert len(runs[1][0]) == 250


def test_preemption_happens_when_kv_is_short_and_not_when_it_is_plentiful() -> None:
    # one class and room for every sequence: only a lack of KV blocks can preempt
    short, _ = run_replica(make_requests(0, 200, 30, priorities=(0,)), num_blocks=250, host_blocks=0, max_num_seqs=256)
    roomy, _ = run_replica(make_requests(0, 200, 30, priorities=(0,)), num_blocks=5000, host_blocks=0, max_num_seqs=256)
    assert short.scheduler.num_preemptions > 0
    assert roomy.scheduler.num_preemptions == 0
    assert short.blocks.num_free_blocks == short.blocks.num_blocks  # everything given back at the end


def test_same_steps_and_preemptions_as_the_real_engine_on_an_offline_batch(demo_model_dir) -> None:
    requests = make_requests(3, 40, 1e9, shared=48, priorities=(0, 1))
    for i, r in enumerate(requests):  # all at once, no cancellations: the schedule is then independent of time
        r.arrival, r.cancel_after = i * 1e-9, None  # the engine's arrival times are distinct too
    engine = Engine(
        EngineConfig.from_options(
            str(demo_model_dir),
            kv_cache_gib=0.0005,
            swap_space_gib=0.0002,
            max_num_seqs=16,
            max_num_batched_tokens=256,
            max_model_len=2048,
        )
    )
    vocab = engine.model_config.vocab_size
    finished_at: dict[str, int] = {}
    for r in requests:
        engine.add_request(
            [t % vocab for t in r.prompt],
            SamplingParams(max_tokens=len(r.output), ignore_eos=True, detokenize=False),
            request_id=r.rid,
            priority=r.priority,
        )
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished_at[out.request_id] = engine.stats.steps
    for r in requests:  # the same token ids on both sides, so the prefix cache hits the same blocks
        r.prompt = [t % vocab for t in r.prompt]
        r.hashes = []
    replica, sink = run_replica(
        requests,
        num_blocks=engine.blocks.num_blocks,
        host_blocks=len(engine.blocks.free_host),
        max_num_seqs=16,
        budget=256,
        swap_threshold=engine.config.swap_threshold_tokens,
        at_once=True,
    )
    assert engine.scheduler.num_preemptions > 0
    assert replica.scheduler.num_preemptions == engine.scheduler.num_preemptions
    assert replica.steps == engine.stats.steps
    assert sink.finished_step == finished_at


def _probe_every(interval: float, until: float, seen: list):
    """Schedules report() calls (what the router's load poll reads) every `interval` simulated seconds."""

    def before(events, replica):
        def probe():
            state = replica.report()
            seen.append(
                (
                    round(events.clock.now, 9),
                    state.running,
                    state.waiting,
                    state.queued_tokens,
                    round(state.kv_usage, 12),
                    replica.steps,
                    round(replica.busy_s, 9),
                )
            )
            if events.clock.now + interval < until:
                events.after(interval, probe)

        events.at(0.0, probe)

    return before


@pytest.mark.parametrize(
    "seed, rate, blocks, events_ratio",
    [
        (5, 6, 2000, 0.5),  # light load: long runs between arrivals
        (6, 25, 350, 0.9),  # KV-short and busy: runs are cut by arrivals and by steps that may preempt
    ],
)
def test_runs_of_parked_steps_give_the_same_results_with_fewer_events(seed, rate, blocks, events_ratio) -> None:
    runs, events = [], []
    for as_runs in (False, True):
        seen: list = []
        replica, sink = run_replica(
            make_requests(seed, 150, rate), num_blocks=blocks, runs=as_runs, before=_probe_every(0.37, 60.0, seen)
        )
        runs.append((sink.done, _histogram(sink.gaps), replica.steps, replica.scheduler.num_preemptions, seen))
        events.append(replica.events.processed)
    assert runs[0] == runs[1]  # results, every gap, and what report() showed mid-run, all the same
    assert len(runs[1][0]) == 150 and len(runs[1][4]) > 100
    assert events[1] < events[0] * events_ratio


def test_an_arrival_during_a_run_is_admitted_at_the_next_step() -> None:
    def two():
        first, second = make_requests(7, 2, 1.0)
        first.arrival, second.arrival = 0.0, 0.5  # the first decodes alone by then: a run, cut by the second
        first.cancel_after = second.cancel_after = None
        return [first, second]

    assert len(two()[0].output) > 100  # long enough that 0.5 s falls inside its decode
    results = []
    for as_runs in (True, False):
        requests = two()
        replica, sink = run_replica(requests, num_blocks=2000, runs=as_runs)
        results.append((sink.done, replica.steps, replica.events.processed))
    assert results[0][:2] == results[1][:2]
    assert results[0][2] < results[1][2]


def test_code_that_touches_the_block_manager_mid_run_sees_and_changes_it_between_steps() -> None:
    """As a KV transfer does (tokenfleet/sim/disagg.py): blocks taken from outside while the replica decodes."""
    from tokenfleet.engine.request import Request

    results = []
    for as_runs in (True, False):
        seen: list = []

        def before(events, replica, seen=seen):
            def grab():
                blocks = replica.blocks
                seen.append(blocks.num_free_blocks)
                holder = Request(
                    "holder",
                    list(range(50_000, 50_000 + 16 * (blocks.num_free_blocks - 3))),
                    SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False),
                )
                blocks.admit(holder, [], holder.num_tokens)  # all but 3 free blocks: later takes run short
                seen.append(blocks.num_free_blocks)

            events.at(0.8, grab)

        requests = make_requests(8, 12, 20.0, priorities=(0,))
        for r in requests:
            r.cancel_after = None
        replica, sink = run_replica(requests, num_blocks=600, host_blocks=0, runs=as_runs, before=before)
        results.append((seen, sink.done, replica.steps, replica.scheduler.num_preemptions))
    assert results[0] == results[1]
    assert results[0][0][1] == 3 and results[0][3] > 0  # the grab left 3 blocks; decodes then got preempted
