"""The admission core that the gateway and the simulator both call: the ladder's verdict (shed counted, never
reserved), the quota's reservation (refusals counted by reason, nothing reserved), tickets costed at what was
reserved, and at the end the slot freed before the reservation is reconciled; the load update sizes each pool to
its replicas taking work and moves the ladder."""

from __future__ import annotations

import asyncio

import pytest

from tests.dispatch.sim import FakeClock, Grant
from tokenfleet.dispatch import Dispatcher, LoadSignal, OverloadLadder, OverloadSettings
from tokenfleet.dispatch.admission import AdmissionCore, OverQuota, Shed
from tokenfleet.dispatch.tiers import default_tiers
from tokenfleet.quota import Limits, MemoryQuota, Scope

SETTINGS = OverloadSettings(ttft_target_s=1.0, cool_down_s=0.0, free_model=None)


def core_with(quota: MemoryQuota | None = None, slots: int = 2) -> AdmissionCore:
    ladder = OverloadLadder(SETTINGS, clock=FakeClock())
    return AdmissionCore(quota, {"m": Dispatcher(default_tiers(), slots)}, ladder)


def overload(core: AdmissionCore, levels: int) -> None:
    for _ in range(levels):  # one step per update; a projected TTFT far past every threshold
        core.ladder.update(LoadSignal(10**9, 0, 1, 1, 1.0))


def test_a_shed_tier_is_counted_and_never_reaches_the_quota():
    quota = MemoryQuota()
    core = core_with(quota)
    overload(core, 3)
    with pytest.raises(Shed) as shed:
        core.plan("free")
    assert shed.value.plan.level == 3 and core.shed[("free",)] == 1
    assert core.plan("paid").action != "shed"


def test_expected_tokens_use_max_tokens_or_the_tenants_typical_output():
    core = core_with()
    assert core.expected_tokens("acme", 100, prompt_tokens=10, choices=2, max_tokens=5) == 20
    assert core.expected_tokens("acme", 100, prompt_tokens=10, choices=2, max_tokens=None) == 210
    core.outputs.observe("acme", 0, 100)  # a tenant whose answers are short reserves less
    assert core.expected_tokens("acme", 100, prompt_tokens=10, choices=1, max_tokens=None) == 100 - 10 + 10


def test_a_refusal_is_counted_by_reason_and_reserves_nothing():
    async def main():
        quota = MemoryQuota()
        core = core_with(quota)
        scope = Scope("org:acme", "acme", Limits(tokens_per_day=50))
        reserved = await core.reserve("r1", "acme", "paid", [scope], 40)
        assert reserved.reservation is not None and reserved.ticket.cost == 40
        with pytest.raises(OverQuota) as refused:
            await core.reserve("r2", "acme", "paid", [scope], 40)
        assert refused.value.tokens == 40 and core.refusals[("paid", refused.value.decision.reason)] == 1
        await core.leave("m", None, reserved.reservation, 15)  # used 15 of 40: the rest comes back
        assert (await core.reserve("r3", "acme", "paid", [scope], 35)).reservation is not None

    asyncio.run(main())


def test_leave_frees_the_slot_before_the_quota_is_reconciled():
    class FailingQuota(MemoryQuota):
        async def reconcile(self, reservation, used_tokens):
            raise ConnectionError("quota store gone")

    async def main():
        core = core_with(FailingQuota(), slots=1)
        reserved = await core.reserve("r1", "acme", "paid", [Scope("org:acme", "acme", Limits())], 10)
        grant = Grant()
        core.dispatchers["m"].submit(reserved.ticket, grant)
        assert grant.slot is not None and core.dispatchers["m"].snapshot().in_use == 1
        with pytest.raises(ConnectionError):
            await core.leave("m", grant.slot, reserved.reservation, 10)
        assert core.dispatchers["m"].snapshot().in_use == 0, "a failing reconcile kept the slot"

    asyncio.run(main())


def test_without_a_quota_everything_is_let_in_with_a_ticket():
    async def main():
        reserved = await core_with(None).reserve("r1", "acme", "free", [], 10**9)
        assert reserved.reservation is None and reserved.ticket.tier == "free"

    asyncio.run(main())


def test_the_load_update_sizes_each_pool_and_moves_the_ladder():
    core = core_with(slots=1)
    assert core.update_load({"m": 3}, 4, replica_queued_tokens=0, pool_prefill_tokens_per_s=3000.0) == 0
    assert core.dispatchers["m"].snapshot().slots == 12
    assert core.update_load({"m": 1}, 4, replica_queued_tokens=10**6, pool_prefill_tokens_per_s=1000.0) == 1
    assert core.update_load({}, 4, replica_queued_tokens=0, pool_prefill_tokens_per_s=0.0) >= 0
    assert core.dispatchers["m"].snapshot().slots == 0  # no replica taking work: no room
