"""Calibrating the cost model on a real engine: record each step's batch (what the scheduler planned) and its
measured duration, fit the step-time coefficients by least squares, and replay a workload on the real engine in
real time to compare with the simulator."""

from __future__ import annotations

import bisect
import random
import time
from dataclasses import dataclass, field

import numpy as np

from tokenfleet.engine.engine import Engine
from tokenfleet.engine.request import SamplingParams
from tokenfleet.sim.cost_model import CostModel, StepBatch, StepCoefficients

FEATURES = ("overhead_s", "per_sequence_s", "per_token_s", "per_attention_pair_s", "per_kv_token_s", "swap_per_block_s")


def features(batch: StepBatch) -> list[float]:
    return [1.0, batch.sequences, batch.tokens, batch.attention_pairs, batch.kv_tokens_read, batch.swapped_blocks]


class StepRecorder:
    """Wraps an engine's scheduler so that every step's plan is kept as a StepBatch (before the step updates it)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.last: StepBatch | None = None
        schedule = engine.scheduler.schedule

        def recording():
            out = schedule()
            batch = StepBatch(swapped_blocks=len(out.swap_in) + len(out.swap_out))
            for chunk in out.chunks:
                batch.add_chunk(chunk.req.num_computed_tokens, chunk.num_tokens)
            self.last = batch
            return out

        engine.scheduler.schedule = recording


def fit(batches: list[StepBatch], durations: list[float]) -> StepCoefficients:
    """Non-negative least squares on the step-time features (a coefficient that comes out negative is dropped
    and the rest refitted). Unweighted, so the predicted total time equals the measured one: queueing delays
    depend on the sum of step times more than on any single step."""
    x = np.array([features(b) for b in batches], dtype=float)
    y = np.array(durations, dtype=float)
    active = [i for i in range(x.shape[1]) if x[:, i].any()]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (coef >= 0).all():
            break
        active.pop(int(np.argmin(coef)))
    values = dict.fromkeys(FEATURES, 0.0)
    for i, c in zip(active, coef):
        values[FEATURES[i]] = float(c)
    return StepCoefficients(weights_s=0.0, combine="sum", **values)


@dataclass
class Arrival:
    rid: str
    at: float  # seconds after the start
    prompt: list[int]
    max_tokens: int
    priority: int = 0


@dataclass
class Measured:
    ttft: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    output_tokens: int = 0
    preemptions: int = 0
    makespan_s: float = 0.0
    batches: list[StepBatch] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)  # the engine's clock at the end of each step


def synthetic_arrivals(seed: int, n: int, rate: float, vocab: int) -> list[Arrival]:
    """Poisson arrivals (rate inf: an offline batch, all at once) of prompts that start with one of three shared
    system prompts, outputs of 16 to 256 tokens, two priority classes."""
    rng = random.Random(seed)
    systems = [[rng.randrange(4, vocab) for _ in range(rng.randint(100, 300))] for _ in range(3)]
    arrivals, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate) if rate != float("inf") else 1e-9
        prompt = rng.choice(systems) + [rng.randrange(4, vocab) for _ in range(rng.randint(20, 400))]
        arrivals.append(Arrival(f"r{i}", t, prompt, rng.randint(16, 256), priority=rng.choice((0, 0, 1))))
    return arrivals


def replay(engine: Engine, arrivals: list[Arrival], clock: str = "cpu") -> Measured:
    """Runs the arrivals on the real engine (each request added once its time has come, steps back to back while
    there is work) and measures TTFT, completions, preemptions and every step's duration.

    clock "wall": real time. clock "cpu": time is the engine thread's CPU time (run torch single-threaded), and
    idle gaps are skipped: what the engine would take on a core of its own, unaffected by other processes on a
    shared machine."""
    if clock not in ("cpu", "wall"):
        raise ValueError(f"clock must be cpu or wall, got {clock!r}")
    recorder, result = StepRecorder(engine), Measured()
    pending = sorted(arrivals, key=lambda a: a.at)
    preempted_before = engine.scheduler.num_preemptions
    tick = time.thread_time if clock == "cpu" else time.perf_counter
    start, now, i = time.perf_counter(), 0.0, 0
    while i < len(pending) or engine.has_unfinished():
        if clock == "wall":
            now = time.perf_counter() - start
        while i < len(pending) and pending[i].at <= now:
            a = pending[i]
            engine.add_request(
                a.prompt,
                SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, detokenize=False),
                request_id=a.rid,
                priority=a.priority,
            )
            i += 1
        if not engine.has_unfinished():
            if clock == "wall":
                time.sleep(max(0.0, pending[i].at - now))
            else:
                now = pending[i].at
            continue
        began = tick()
        outputs = engine.step()
        duration = tick() - began
        now = now + duration if clock == "cpu" else time.perf_counter() - start
        result.batches.append(recorder.last)
        result.durations.append(duration)
        result.ends.append(now)
        for out in outputs:
            if out.request_id not in result.ttft:
                result.ttft[out.request_id] = now
            if out.finished:
                result.finished[out.request_id] = now
                result.output_tokens += len(out.token_ids)
    result.makespan_s = now
    result.preemptions = engine.scheduler.num_preemptions - preempted_before
    arrived = {a.rid: a.at for a in arrivals}
    result.ttft = {rid: t - arrived[rid] for rid, t in result.ttft.items()}
    return result


def fit_error(coefficients: StepCoefficients, batches: list[StepBatch], durations: list[float]) -> dict:
    """How well the cost model predicts measured steps: mean absolute relative error, and total time ratio."""
    model = CostModel(coefficients)
    predicted = [model.step_time(b) for b in batches]
    errors = [abs(p - d) / d for p, d in zip(predicted, durations) if d > 0]
    return {
        "steps": len(durations),
        "mean_abs_rel_error": sum(errors) / len(errors),
        "total_predicted_over_measured": sum(predicted) / sum(durations),
    }


def residual_ratios(coefficients: StepCoefficients, batches: list[StepBatch], durations: list[float]) -> list[float]:
    """Measured / predicted time of every measured step: the scatter of the real steps around the cost model."""
    model = CostModel(coefficients)
    return [d / p for d, p in ((d, model.step_time(b)) for b, d in zip(batches, durations)) if p > 0 and d > 0]


class _RescaledCostModel(CostModel):
    """The cost model with every step's time multiplied by `_factor(ahead)`, asked once per step; `ahead` is how
    far past the clock's time the step starts (0 but for the later steps of a run priced at once, decode_times)."""

    def _factor(self, ahead: float) -> float:
        raise NotImplementedError

    def step_time(self, batch: StepBatch) -> float:
        return super().step_time(batch) * self._factor(0.0)

    def decode_time(self, sequences: int, contexts: int) -> float:
        return super().decode_time(sequences, contexts) * self._factor(0.0)

    def decode_times(self, sequences: int, contexts: int, growth: int, count: int) -> list[float]:
        times, ahead = [], 0.0
        for t in super().decode_times(sequences, contexts, growth, count):
            times.append(t * self._factor(ahead))
            ahead += times[-1]
        return times


class ScatteredCostModel(_RescaledCostModel):
    """The cost model with the real steps' scatter: each step's time is multiplied by a ratio drawn (seeded) from
    measured ones (residual_ratios), so that simulations with different seeds spread as repeated real runs of one
    workload do. Near the KV limit a tail percentile or a preemption count moves a lot with small timing changes;
    the mean over seeds is what compares with the mean of real runs."""

    def __init__(self, coefficients: StepCoefficients, ratios: list[float], seed: int) -> None:
        super().__init__(coefficients)
        if not ratios:
            raise ValueError("no measured steps to take the scatter from")
        self.ratios, self.rng = ratios, random.Random(seed)

    def _factor(self, ahead: float) -> float:
        return self.rng.choice(self.ratios)


@dataclass
class MachineNoise:
    """How measured steps strayed from the cost model, in two parts: the machine's speed per window of the
    engine's clock (measured / predicted, in time order), and each step's ratio to its window's speed."""

    window_s: float
    drift: list[float]
    ratios: list[float]


def machine_noise(coefficients: StepCoefficients, runs: list[Measured], window_s: float) -> MachineNoise:
    model, noise = CostModel(coefficients), MachineNoise(window_s, [], [])
    for measured in runs:
        predicted = _predicted(measured, model)  # each step priced once, for its window and its scatter
        speeds = _window_speeds(measured, predicted, window_s)
        noise.drift += [speeds[k] for k in sorted(speeds)]
        for want, duration, end in zip(predicted, measured.durations, measured.ends):
            if want > 0 and duration > 0:
                noise.ratios.append(duration / want / speeds[int((end - duration) // window_s)])
    return noise


class DriftingCostModel(ScatteredCostModel):
    """ScatteredCostModel with the machine's speed drifting as it did while calibrating: simulated window k runs
    at the measured window speed drift[(start + k) % len], `start` drawn from the seed, so slow stretches come and
    last as measured ones did; each step is then scattered as steps were within their window. Near the KV limit a
    slow stretch is what tips a run into preemptions and a long TTFT tail, which per-step scatter alone averages
    away."""

    def __init__(self, coefficients: StepCoefficients, noise: MachineNoise, seed: int, clock) -> None:
        super().__init__(coefficients, noise.ratios, seed)
        if not noise.drift:
            raise ValueError("no measured windows to take the drift from")
        self.drift, self.window_s, self.clock = noise.drift, noise.window_s, clock
        self.start = self.rng.randrange(len(noise.drift))

    def _factor(self, ahead: float) -> float:
        window = int((self.clock.now + ahead) // self.window_s)
        return self.drift[(self.start + window) % len(self.drift)] * super()._factor(ahead)


class ProfiledCostModel(_RescaledCostModel):
    """Diagnostic: the cost model slowed or sped up over time as a real run's machine was: `profile` holds (start
    of a window of the engine's clock, measured / predicted step time in it), `clock` is the simulation's. It tells
    how much of a difference in a time-sensitive number (a tail) comes from the machine's speed changing during
    the run rather than from the scheduling model."""

    def __init__(self, coefficients: StepCoefficients, profile: list[tuple[float, float]], clock) -> None:
        super().__init__(coefficients)
        self.starts, self.factors, self.clock = [t for t, _ in profile], [f for _, f in profile], clock

    def _factor(self, ahead: float) -> float:
        i = bisect.bisect_right(self.starts, self.clock.now + ahead) - 1
        return self.factors[max(i, 0)]


def speed_profile(measured: Measured, coefficients: StepCoefficients, window_s: float) -> list[tuple[float, float]]:
    """A real run's speed over time: measured / predicted step time per window of the engine's clock."""
    speeds = _window_speeds(measured, _predicted(measured, CostModel(coefficients)), window_s)
    return [(k * window_s, speeds[k]) for k in sorted(speeds)]


def _predicted(measured: Measured, model: CostModel) -> list[float]:
    return [model.step_time(batch) for batch in measured.batches]


def _window_speeds(measured: Measured, predicted: list[float], window_s: float) -> dict[int, float]:
    """Window number (of the engine's clock, by each step's start) -> measured / predicted step time in it.
    `predicted`: the cost model's time for each of the measured steps."""
    sums: dict[int, tuple[float, float]] = {}
    for want_step, duration, end in zip(predicted, measured.durations, measured.ends):
        key = int((end - duration) // window_s)
        got, want = sums.get(key, (0.0, 0.0))
        sums[key] = (got + duration, want + want_step)
    return {k: got / want if want > 0 else 1.0 for k, (got, want) in sums.items()}


class _Sink:
    def __init__(self, result: Measured) -> None:
        self.result = result

    def first_token(self, sreq, now: float) -> None:
        self.result.ttft[sreq.rid] = now - sreq.arrival

    def finished(self, sreq, now: float, reason: str) -> None:
        self.result.finished[sreq.rid] = now
        self.result.output_tokens += sreq.tokens_out

    def inter_token(self, tier: str, gap_s: float, count: int) -> None:
        pass

    def inter_tokens(self, gap_s: float, per_tier: dict) -> None:
        pass


def simulate(arrivals: list[Arrival], spec, cost, clock=None) -> Measured:
    """The same arrivals on one simulated replica (the engine's scheduler and block manager, the cost model).
    `clock`: the SimClock to run on (a cost model that reads the simulated time shares it)."""
    from tokenfleet.engine.kv_blocks import prefix_block_hashes
    from tokenfleet.sim.events import EventQueue, SimClock
    from tokenfleet.sim.replica import SimReplica
    from tokenfleet.sim.request import SimRequest

    result = Measured()
    events = EventQueue(clock or SimClock())
    replica = SimReplica("sim", spec, cost, events, _Sink(result))
    for i, a in enumerate(arrivals):
        output = [(i * 7919 + k) % 1000 for k in range(a.max_tokens)]  # never matched by another request
        sreq = SimRequest(
            a.rid,
            "paid",
            "org",
            "user",
            a.priority,
            a.prompt,
            output,
            prefix_block_hashes(a.prompt, spec.block_size),
            a.at,
        )
        events.at(a.at, replica.add, sreq)
    events.run()
    result.makespan_s = events.clock.now
    result.preemptions = replica.scheduler.num_preemptions
    return result
