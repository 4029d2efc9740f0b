"""Randomized submit / cancel / finish / preempt sequences never leak or double-own a KV block."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenfleet.engine.kv_blocks import KVBlockManager
from tokenfleet.engine.request import Request, RequestStatus, SamplingParams
from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig

BLOCK = 4


def check_invariants(blocks: KVBlockManager, sched: Scheduler, host_blocks: int) -> None:
    device_refs: Counter[int] = Counter()
    host_owned: list[int] = []
    for req in sched.running:
        assert req.status is RequestStatus.RUNNING
        device_refs.update(req.block_table)
    for req in sched.queue:
        if req.status is RequestStatus.SWAPPED:
            host_owned.extend(req.block_table)
        else:
            assert req.status is RequestStatus.WAITING and req.block_table == []
    assert len(blocks.ref_counts) == len(blocks.keys) <= blocks.num_blocks
    for block_id, (ref_count, key) in enumerate(zip(blocks.ref_counts, blocks.keys)):
        assert ref_count == device_refs[block_id], "ref count differs from the owning block tables"
        free_as = [block_id in blocks.free_plain, block_id in blocks.free_cached]
        assert sum(free_as) == (ref_count == 0), "a block is neither free nor owned, or free twice"
        assert not free_as[0] or key is None, "a block holding a cached prefix is in the plain free list"
        assert not free_as[1] or key is not None, "a block without a cached prefix is in the cached free list"
    for key, block_id in blocks.cached.items():
        assert blocks.keys[block_id] == key
    assert len(host_owned) == len(set(host_owned)), "a host block is owned twice"
    assert sorted(host_owned + blocks.free_host) == list(range(host_blocks)), "a host block leaked"


operations = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(1, 40), st.integers(1, 30), st.integers(0, 2), st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(0, 10**6)),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
    ),
    min_size=1,
    max_size=80,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=operations,
    num_blocks=st.integers(12, 40),
    threshold=st.sampled_from([4, 1000]),
    budget=st.sampled_from([8, 32, 256]),
    prefix_caching=st.booleans(),
)
def test_every_block_is_free_cached_or_owned(ops, num_blocks, threshold, budget, prefix_caching):
    host_blocks = 16
    blocks = KVBlockManager(num_blocks, BLOCK, host_blocks, watermark=0.05, enable_prefix_caching=prefix_caching)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, swap_threshold_tokens=threshold), blocks
    )
    live: list[Request] = []
    for i, op in enumerate(ops):
        if op[0] == "submit":
            _, prompt_len, max_tokens, priority, prefix = op
            # prompts share a prefix family so the prefix cache gets hits; capacity-checked like the engine does
            if blocks.blocks_for(prompt_len + max_tokens) > num_blocks - blocks.watermark_blocks:
                continue
            prompt = [prefix] * min(prompt_len, 8) + list(range(100, 100 + max(0, prompt_len - 8)))
            req = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), priority=priority)
            sched.add(req)
            live.append(req)
        elif op[0] == "step":
            run_step(sched, op[1])
        elif live:
            req = live[op[1] % len(live)]
            sched.finish(req, "abort")
        live = [r for r in live if not r.is_finished]
        check_invariants(blocks, sched, host_blocks)
    for req in live:
        sched.finish(req, "abort")
    check_invariants(blocks, sched, host_blocks)
    assert blocks.num_free_blocks == num_blocks
    assert not sched.has_work()


def run_step(sched: Scheduler, token: int) -> None:
    out = sched.schedule()
    sampled = [c.req for c in out.chunks if c.samples]
    sched.update(out)
    for req in sampled:
        req.append_token(token % 50)
        if req.num_output_tokens >= req.params.max_tokens:
            sched.finish(req, "length")


def test_scheduling_drains_everything_under_pressure():
    """A long run of mixed priorities through a tiny cache finishes every request and returns every block."""
    blocks = KVBlockManager(16, BLOCK, 8, watermark=0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, swap_threshold_tokens=8), blocks)
    reqs = [
        Request(f"r{i}", list(range(i, i + 10 + i % 7)), SamplingParams(max_tokens=12), priority=i % 3)
        for i in range(20)
    ]
    for req in reqs:
        sched.add(req)
    for step in range(2000):
        if not sched.has_work():
            break
        run_step(sched, step)
        check_invariants(blocks, sched, 8)
    assert all(r.is_finished and r.num_output_tokens == 12 for r in reqs)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert blocks.num_free_blocks == 16


def test_higher_class_preempts_lower_and_never_the_reverse():
    blocks = KVBlockManager(8, BLOCK, 0, watermark=0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), blocks)
    low = [Request(f"low{i}", list(range(12)), SamplingParams(max_tokens=20), priority=2) for i in range(2)]
    for req in low:
        sched.add(req)
    run_step(sched, 1)  # both low requests run, 3 blocks each + growth
    assert all(r.status is RequestStatus.RUNNING for r in low)
    high = Request("high", list(range(50, 70)), SamplingParams(max_tokens=4), priority=0)
    sched.add(high)
    run_step(sched, 2)
    assert high.status is RequestStatus.RUNNING, "the paid request waited behind batch work"
    assert any(r.num_preemptions for r in low)
    # a lower class arriving now cannot push the high one out
    batch = Request("batch", list(range(80, 110)), SamplingParams(max_tokens=4), priority=3)
    sched.add(batch)
    run_step(sched, 3)
    assert high.num_preemptions == 0


def test_free_blocks_are_taken_unused_first_then_never_used_then_least_recently_cached():
    """The free list's order: blocks freed without a cached prefix, then blocks never used (created only when first
    taken), then blocks holding a cached prefix, least recently freed first."""
    blocks = KVBlockManager(6, BLOCK, 0, watermark=0.0)
    assert blocks.num_free_blocks == 6 and blocks.ref_counts == [] and blocks.usage() == 0.0
    cached = Request("cached", list(range(2 * BLOCK)), SamplingParams(max_tokens=1))
    blocks.admit(cached, [], 2 * BLOCK)
    blocks.mark_computed(cached, 2 * BLOCK)
    scratch = Request("scratch", list(range(100, 100 + BLOCK - 1)), SamplingParams(max_tokens=1))
    blocks.admit(scratch, [], BLOCK - 1)
    assert (cached.block_table, scratch.block_table) == ([0, 1], [2])
    assert len(blocks.ref_counts) == 3 and blocks.num_free_blocks == 3 and blocks.usage() == 0.5
    blocks.free_request(cached)  # cached prefixes: kept, taken last
    blocks.free_request(scratch)  # nothing cached: taken first
    taker = Request("taker", list(range(200, 200 + 6 * BLOCK)), SamplingParams(max_tokens=1))
    blocks.admit(taker, [], 6 * BLOCK)
    assert taker.block_table == [2, 3, 4, 5, 1, 0]  # the scratch block, the never used ones, then LRU cached
    assert blocks.num_free_blocks == 0 and blocks.cached == {}  # evicting took the cached prefixes out
    blocks.free_request(taker)
    assert blocks.num_free_blocks == 6
