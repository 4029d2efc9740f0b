"""The cost model against hand calculations (numbers worked out in the comments)."""

from __future__ import annotations

import dataclasses

import pytest

from tokenfleet.sim.calibration import (
    DriftingCostModel,
    MachineNoise,
    Measured,
    ProfiledCostModel,
    ScatteredCostModel,
    machine_noise,
    speed_profile,
)
from tokenfleet.sim.cost_model import CostModel, StepBatch, StepCoefficients, kv_cache_blocks, roofline
from tokenfleet.sim.events import SimClock
from tokenfleet.sim.hardware import hardware
from tokenfleet.sim.models import model_shape

LLAMA_70B = model_shape("llama-70b")


def test_kv_bytes_per_token_is_the_designs_320_kb() -> None:
    assert LLAMA_70B.kv_bytes_per_token("fp16") == 2 * 80 * 8 * 128 * 2 == 327_680


def test_decode_step_70b_fp16_tp8_h100_by_hand() -> None:
    # 64 sequences decoding at a context of 2,000 tokens.
    # memory: weights 70.6e9 x 2 B = 141.2 GB; KV read 64 x 2,001 tokens x 327,680 B = 41.97 GB
    #         over 8 GPUs x 3.35 TB/s x 0.8 = 21.44 TB/s            -> (141.2 + 41.97) GB / 21.44 TB/s = 8.543 ms
    # compute: 2 x 70.6e9 x 64 = 9.04 TFLOP over 8 x 989 TFLOP/s x 0.5 -> 2.285 ms (+ attention 0.12 ms): below memory
    # all-reduce: 160 x (8 us + 64 x 8192 x 2 B x 1.75 / (450 GB/s x 0.7)) = 160 x 13.83 us = 2.213 ms
    # overhead: 2 ms + 64 x 10 us = 2.64 ms                            -> total 13.40 ms
    cost = CostModel(roofline(LLAMA_70B, hardware("h100"), "fp16", "fp16", tp=8))
    assert cost.decode_step_time(64, 2000) == pytest.approx(13.40e-3, rel=0.005)


def test_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    c = roofline(LLAMA_70B, hardware("h100"), "fp8", "fp8", tp=8)
    decode, prefill = StepBatch(), StepBatch()
    for _ in range(32):
        decode.add_chunk(1000, 1)
    prefill.add_chunk(0, 2048)
    assert c.weights_s + c.per_kv_token_s * decode.kv_tokens_read > c.per_token_s * decode.tokens
    assert c.per_token_s * prefill.tokens > c.weights_s + c.per_kv_token_s * prefill.kv_tokens_read
    # prefill of 2,048 tokens: 2 x 70.6e9 x 2048 = 289 TFLOP over 8 x 1979 x 0.5 TFLOP/s = 36.5 ms of linear layers
    assert c.per_token_s * 2048 == pytest.approx(36.5e-3, rel=0.01)


def test_h200_decodes_faster_and_fp8_halves_the_weight_read() -> None:
    h100 = CostModel(roofline(LLAMA_70B, hardware("h100"), "fp16", "fp16", tp=8))
    h200 = CostModel(roofline(LLAMA_70B, hardware("h200"), "fp16", "fp16", tp=8))
    assert h200.decode_step_time(64, 2000) < h100.decode_step_time(64, 2000)
    fp8 = roofline(LLAMA_70B, hardware("h100"), "fp8", "fp16", tp=8)
    fp16 = roofline(LLAMA_70B, hardware("h100"), "fp16", "fp16", tp=8)
    assert fp8.weights_s == pytest.approx(fp16.weights_s / 2)


def test_kv_cache_size_is_memory_minus_weights() -> None:
    # 8 x (80 GB x 0.9 - 4 GB) = 544 GB; minus 70.6 GB of FP8 weights = 473.4 GB; / (16 x 327,680 B) = 90,293 blocks
    blocks = kv_cache_blocks(LLAMA_70B, hardware("h100"), "fp8", "fp16", tp=8, block_size=16)
    assert blocks == int((8 * (80e9 * 0.9 - 4e9) - 70.6e9) // (16 * 327_680))


@pytest.mark.parametrize("dtype, tp", [("fp16", 1), ("fp16", 2), ("fp8", 1)])
def test_a_70b_model_that_does_not_fit_is_refused(dtype: str, tp: int) -> None:
    with pytest.raises(ValueError, match="does not fit"):
        kv_cache_blocks(LLAMA_70B, hardware("h100"), dtype, "fp16", tp=tp, block_size=16)


def test_bad_tensor_parallel_and_unknown_gpu_are_refused() -> None:
    with pytest.raises(ValueError, match="power of two"):
        kv_cache_blocks(LLAMA_70B, hardware("h100"), "fp8", "fp16", tp=3, block_size=16)
    with pytest.raises(ValueError, match="unknown GPU"):
        hardware("a100")


@pytest.mark.parametrize("combine", ["max", "sum"])
def test_decode_times_are_decode_time_step_by_step(combine: str) -> None:
    coefficients = roofline(LLAMA_70B, hardware("h100"), "fp8", "fp16", 8)
    model = CostModel(dataclasses.replace(coefficients, combine=combine))
    times = model.decode_times(37, 40_000, 37, 500)  # contexts grow by one token per sequence per step
    assert times == [model.decode_time(37, 40_000 + 37 * k) for k in range(500)]  # the same floats
    assert times[-1] > times[0]


def _coefficients() -> StepCoefficients:
    return StepCoefficients(
        overhead_s=0.01,
        per_sequence_s=0.0,
        per_token_s=0.001,
        per_attention_pair_s=0.0,
        weights_s=0.0,
        per_kv_token_s=0.0,
        combine="sum",
    )


def test_the_scattered_model_multiplies_each_step_by_a_measured_ratio() -> None:
    plain = CostModel(_coefficients())
    batch = StepBatch(prefill_tokens=10, sequences=1)  # 0.01 + 10 x 0.001 = 0.02 s
    scattered = ScatteredCostModel(_coefficients(), [0.5, 2.0], seed=1)
    times = {round(scattered.step_time(batch) / plain.step_time(batch), 9) for _ in range(50)}
    assert times == {0.5, 2.0}  # only measured ratios, both drawn
    a, b = (ScatteredCostModel(_coefficients(), [0.5, 1.0, 2.0], seed=7) for _ in range(2))
    assert a.decode_times(4, 100, 4, 20) == b.decode_times(4, 100, 4, 20)  # same seed, same draws
    with pytest.raises(ValueError, match="no measured steps"):
        ScatteredCostModel(_coefficients(), [], seed=0)


def test_a_runs_speed_profile_slows_the_model_where_the_run_was_slow() -> None:
    batch = StepBatch(prefill_tokens=10, sequences=1)  # predicted 0.02 s
    # steps of 0.02 s for the first 2 s of the engine's clock, then of 0.03 s (1.5x slower)
    measured = _measured_run([(0.0, [0.02] * 100 + [0.03] * 100)], batch)
    profile = speed_profile(measured, _coefficients(), window_s=2.0)
    assert [round(f, 6) for _, f in profile] == [1.0, 1.5, 1.5]
    clock = SimClock()
    model = ProfiledCostModel(_coefficients(), profile, clock)
    assert model.step_time(batch) == pytest.approx(0.02)
    clock.now = 2.5
    assert model.step_time(batch) == pytest.approx(0.03)
    assert model.decode_times(1, 0, 0, 3) == pytest.approx([1.5 * CostModel(_coefficients()).decode_time(1, 0)] * 3)


def _measured_run(segments: list[tuple[float, list[float]]], batch: StepBatch) -> Measured:
    """A run of back-to-back steps in each (start on the engine's clock, step durations) segment."""
    measured = Measured()
    for t, durations in segments:
        for duration in durations:
            t += duration
            measured.batches.append(batch), measured.durations.append(duration), measured.ends.append(t)
    return measured


def test_machine_noise_splits_a_runs_timing_into_window_speeds_and_scatter_within_them() -> None:
    batch = StepBatch(prefill_tokens=10, sequences=1)  # predicted 0.02 s
    # window 0: steps alternate 0.8x and 1.2x (speed 1.0); window 1: steps alternate 1.2x and 1.8x (speed 1.5)
    run = _measured_run([(0.0, [0.016, 0.024] * 45), (2.1, [0.024, 0.036] * 30)], batch)
    noise = machine_noise(_coefficients(), [run, run], window_s=2.0)
    assert [round(f, 6) for f in noise.drift] == [1.0, 1.5] * 2  # two runs, one after the other
    assert {round(r, 6) for r in noise.ratios} == {0.8, 1.2}  # scatter without the window's speed
    assert len(noise.ratios) == 2 * len(run.durations)


def test_the_drifting_model_follows_the_measured_window_speeds_in_order_from_a_seeded_start() -> None:
    batch = StepBatch(prefill_tokens=10, sequences=1)  # predicted 0.02 s
    noise = MachineNoise(window_s=1.0, drift=[1.0, 2.0, 3.0], ratios=[1.0])
    clock = SimClock()
    model = DriftingCostModel(_coefficients(), noise, seed=3, clock=clock)
    speeds = []
    for now in (0.5, 1.5, 2.5, 3.5):
        clock.now = now
        speeds.append(round(model.step_time(batch) / 0.02, 6))
    first = speeds[0]
    assert speeds == [first, first % 3 + 1, (first + 1) % 3 + 1, first]  # consecutive windows, wrapping around
    assert DriftingCostModel(_coefficients(), noise, seed=3, clock=SimClock()).start == model.start
    # a run of steps priced at once: each step at the speed of the window it starts in
    clock.now = 0.0
    times = model.decode_times(1, 0, 0, 4)
    step = CostModel(_coefficients()).decode_time(1, 0)
    starts = [sum(times[:i]) for i in range(4)]
    assert times == pytest.approx([step * noise.drift[(model.start + int(s)) % 3] for s in starts])
    with pytest.raises(ValueError, match="no measured windows"):
        DriftingCostModel(_coefficients(), MachineNoise(1.0, [], [1.0]), seed=0, clock=clock)
