"""The simulator against the real engine, small: the tiny demo checkpoint, calibrated and replayed here.

The 15% claim is made by bench/sim_validation.py on the medium checkpoint (docs/benchmarks/simulator_validation.md).
Here steps last about a millisecond, so per-step timing noise on a shared CI machine is large next to them: the
time-based checks are loose (35%). The preemption count of an offline batch does not depend on time and is exact.
"""

from __future__ import annotations

import pytest
import torch

from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.engine import Engine
from tokenfleet.engine.scheduler import SchedulerConfig
from tokenfleet.sim.calibration import fit, replay, simulate, synthetic_arrivals
from tokenfleet.sim.cost_model import CostModel
from tokenfleet.sim.replica import ReplicaSpec

OPTIONS = dict(
    kv_cache_gib=0.0015, swap_space_gib=0.0005, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024
)


@pytest.fixture
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the replay's clock is the engine thread's CPU time
    yield
    torch.set_num_threads(threads)


def _engine(model_dir) -> Engine:
    engine = Engine(EngineConfig.from_options(str(model_dir), **OPTIONS))
    replay(engine, synthetic_arrivals(99, 4, float("inf"), engine.model_config.vocab_size))  # warm up
    return engine


def test_calibrated_simulator_matches_the_real_engine(demo_model_dir, single_thread) -> None:
    engine = _engine(demo_model_dir)
    vocab = engine.model_config.vocab_size
    batches, durations = [], []
    for seed, rate in ((1, float("inf")), (2, 40.0)):
        measured = replay(engine, synthetic_arrivals(seed, 30, rate, vocab))
        batches, durations = batches + measured.batches, durations + measured.durations
    cost = CostModel(fit(batches, durations))
    spec = ReplicaSpec(
        engine.blocks.num_blocks,
        engine.config.block_size,
        len(engine.blocks.free_host),
        engine.config.watermark,
        True,
        1024,
        SchedulerConfig(16, 256, engine.config.swap_threshold_tokens),
    )
    arrivals = synthetic_arrivals(3, 30, float("inf"), vocab)
    real = replay(_engine(demo_model_dir), arrivals)
    sim = simulate(arrivals, spec, cost)
    assert real.preemptions > 0
    assert sim.preemptions == real.preemptions
    assert sim.output_tokens == real.output_tokens
    real_rate = real.output_tokens / max(real.finished.values())
    sim_rate = sim.output_tokens / max(sim.finished.values())
    assert sim_rate == pytest.approx(real_rate, rel=0.35)
    mean = lambda m: sum(m.ttft.values()) / len(m.ttft)  # noqa: E731
    assert mean(sim) == pytest.approx(mean(real), rel=0.35)
