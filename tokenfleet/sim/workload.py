"""Arrivals: conversations starting on a diurnal curve with bursts; each has a tier, a tenant, a shared system
prompt and several turns whose prompts carry the whole history (so the prefix cache matters); some are cancelled.

Content is drawn from a random stream per conversation (seeded by the run's seed and the conversation's number),
so the same seed gives the same conversations whatever the fleet, router or policy does with them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.sim.numbers import is_finite, is_whole
from tokenfleet.sim.request import SimRequest

TIERS = ("enterprise", "paid", "free", "batch")
SYSTEM_TOKEN_BASE = 1 << 40  # synthetic token ids: system prompts here, everything else from a counter below


WHOLE = ("orgs_per_tier", "users_per_org", "system_prompts", "max_output_tokens", "max_model_len")
REAL = (
    "rate",
    "diurnal_amplitude",
    "diurnal_period_s",
    "peak_at_s",
    "user_tokens_mean",
    "output_tokens_mean",
    "length_sigma",
    "turns_mean",
    "think_time_s",
    "cancel_probability",
    "batch_prompt_tokens_mean",
)


@dataclass(frozen=True)
class Burst:
    at_s: float
    duration_s: float
    multiplier: float


@dataclass(frozen=True)
class WorkloadSpec:
    rate: float = 10.0  # requests per second, averaged over the diurnal curve (conversation turns included)
    diurnal_amplitude: float = 0.0  # rate x (1 + amplitude x cos(2 pi (t - peak_at_s) / period_s))
    diurnal_period_s: float = 86400.0
    peak_at_s: float = 0.0
    bursts: tuple[Burst, ...] = ()
    tiers: dict = field(default_factory=lambda: {"enterprise": 0.1, "paid": 0.3, "free": 0.5, "batch": 0.1})
    orgs_per_tier: int = 50
    users_per_org: int = 20
    system_prompts: int = 8
    system_prompt_tokens: tuple[int, int] = (100, 700)
    user_tokens_mean: float = 100.0
    output_tokens_mean: float = 400.0
    length_sigma: float = 0.8  # lognormal shape of user and output lengths
    max_output_tokens: int = 2048
    turns_mean: float = 3.0  # turns per chat conversation (geometric)
    think_time_s: float = 20.0  # mean pause between an answer and the next turn
    cancel_probability: float = 0.05  # per turn: the user stops it while it runs (and leaves)
    batch_prompt_tokens_mean: float = 2000.0  # batch requests: one turn, a long document, no shared prefix
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        for name in WHOLE:
            if not is_whole(getattr(self, name)):
                raise ValueError(f"{name} must be a whole number, got {getattr(self, name)!r}")
        for name in REAL:
            if not is_finite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        numbers = {
            "rate": self.rate,
            "orgs_per_tier": self.orgs_per_tier,
            "users_per_org": self.users_per_org,
            "system_prompts": self.system_prompts,
            "user_tokens_mean": self.user_tokens_mean,
            "output_tokens_mean": self.output_tokens_mean,
            "turns_mean": self.turns_mean,
            "max_output_tokens": self.max_output_tokens,
            "diurnal_period_s": self.diurnal_period_s,
            "batch_prompt_tokens_mean": self.batch_prompt_tokens_mean,
        }
        bad = [k for k, v in numbers.items() if not v > 0]
        if bad:
            raise ValueError(f"{', '.join(bad)} must be positive")
        if self.turns_mean < 1:
            raise ValueError("turns_mean must be at least 1")
        if not 0 <= self.diurnal_amplitude <= 1:
            raise ValueError("diurnal_amplitude must be in [0, 1]")
        if not 0 <= self.cancel_probability <= 1:
            raise ValueError("cancel_probability must be in [0, 1]")
        if self.think_time_s < 0 or self.length_sigma < 0:
            raise ValueError("think_time_s and length_sigma must be >= 0")
        self._check_tiers()
        for i, b in enumerate(self.bursts):
            if not all(is_finite(v) for v in (b.at_s, b.duration_s, b.multiplier)) or (
                b.duration_s <= 0 or b.multiplier < 0 or b.at_s < 0
            ):
                raise ValueError(
                    f"bursts[{i}]: a burst needs finite numbers at_s >= 0, duration_s > 0 and multiplier >= 0, got {b}"
                )
        tokens = self.system_prompt_tokens
        if not (isinstance(tokens, (tuple, list)) and len(tokens) == 2 and all(is_whole(t) for t in tokens)):
            raise ValueError(f"system_prompt_tokens must be [low, high], two whole numbers, got {tokens!r}")
        low, high = tokens
        if not 0 < low <= high or high + self.max_output_tokens >= self.max_model_len:
            raise ValueError(
                "system_prompt_tokens must be [low, high] with 0 < low <= high and room for "
                "max_output_tokens within the model's context"
            )

    def _check_tiers(self) -> None:
        unknown = sorted(set(self.tiers) - set(TIERS))
        if unknown:
            raise ValueError(f"unknown tier(s) {', '.join(unknown)}; known: {', '.join(TIERS)}")
        if any(not (is_finite(w) and w >= 0) for w in self.tiers.values()) or not sum(self.tiers.values()) > 0:
            raise ValueError(f"tiers: shares must be finite numbers >= 0 and not all zero, got {self.tiers}")

    def rate_at(self, t: float) -> float:
        """Requests per second at simulated time t."""
        rate = self.rate * (
            1 + self.diurnal_amplitude * math.cos(2 * math.pi * (t - self.peak_at_s) / self.diurnal_period_s)
        )
        for b in self.bursts:
            if b.at_s <= t < b.at_s + b.duration_s:
                rate *= b.multiplier
        return rate

    def max_rate(self) -> float:
        return self.rate * (1 + self.diurnal_amplitude) * max([1.0] + [b.multiplier for b in self.bursts])


@dataclass(eq=False)
class Conversation:
    cid: int
    tier: str
    tenant: str
    user: str
    turns: int
    rng: random.Random
    history: list[int]
    history_hashes: list[bytes]
    turn: int = 0


class Workload:
    def __init__(self, spec: WorkloadSpec, seed: int, block_size: int = 16) -> None:
        self.spec, self.seed, self.block_size = spec, seed, block_size
        self._arrivals = random.Random(f"arrivals:{seed}")
        shared = random.Random(f"system:{seed}")
        self.systems = [
            list(
                range(
                    SYSTEM_TOKEN_BASE + i * 100_000,
                    SYSTEM_TOKEN_BASE + i * 100_000 + shared.randint(*spec.system_prompt_tokens),
                )
            )
            for i in range(spec.system_prompts)
        ]
        self._system_hashes = [block_keys(s, block_size, []) for s in self.systems]
        self._tiers = [t for t in TIERS if spec.tiers.get(t, 0) > 0]
        self._tier_weights = [spec.tiers[t] for t in self._tiers]
        self._org_cum = list(_cumulative([1 / (i + 1) for i in range(spec.orgs_per_tier)]))  # Zipf-like tenants
        share = sum(self._tier_weights)
        turns = sum(w * (1 if t == "batch" else spec.turns_mean) for t, w in zip(self._tiers, self._tier_weights))
        self.turns_per_conversation = turns / share
        self._next_cid = 0
        self._t = 0.0

    def next_start(self) -> float:
        """Simulated time of the next conversation's first turn (thinning against the peak rate)."""
        spec, rng = self.spec, self._arrivals
        peak = spec.max_rate() / self.turns_per_conversation
        while True:
            self._t += rng.expovariate(peak)
            if rng.random() * peak <= spec.rate_at(self._t) / self.turns_per_conversation:
                return self._t

    def conversation(self) -> Conversation:
        cid = self._next_cid
        self._next_cid += 1
        spec = self.spec
        rng = random.Random(self.seed * 1_000_003 + cid)
        tier = rng.choices(self._tiers, self._tier_weights)[0]
        org = rng.choices(range(spec.orgs_per_tier), cum_weights=self._org_cum)[0]
        turns = 1 if tier == "batch" else _geometric(rng, spec.turns_mean)
        system = rng.randrange(len(self.systems))
        return Conversation(
            cid,
            tier,
            f"{tier}-org{org}",
            f"u{rng.randrange(spec.users_per_org)}",
            turns,
            rng,
            self.systems[system],
            self._system_hashes[system],
        )

    def next_turn(self, conv: Conversation, now: float, priority: int) -> SimRequest | None:
        """The conversation's next request, or None when it is over (all turns done). A turn whose prompt and answer
        do not fit max_model_len comes back with status "length": the gateway refuses it (400
        context_length_exceeded), and the conversation ends there."""
        spec, rng = self.spec, conv.rng
        if conv.turn >= conv.turns:
            return None
        mean_in = spec.batch_prompt_tokens_mean if conv.tier == "batch" else spec.user_tokens_mean
        user_n = _lognormal(rng, mean_in, spec.length_sigma)
        out_n = min(spec.max_output_tokens, _lognormal(rng, spec.output_tokens_mean, spec.length_sigma))
        base = (conv.cid * 256 + conv.turn) * 2 << 16
        prompt = conv.history + list(range(base, base + user_n))
        if len(prompt) + out_n > spec.max_model_len:
            refused = _turn_request(conv, priority, now, prompt, [], [], max_tokens=out_n, status="length")
            conv.turn = conv.turns
            return refused
        output = list(range(base + (1 << 16), base + (1 << 16) + out_n))
        known = len(conv.history_hashes) * self.block_size  # the history's blocks have their keys already
        hashes = block_keys(prompt[known:] + output, self.block_size, conv.history_hashes)
        cancel = rng.uniform(0.5, 1.0 + 0.03 * out_n) if rng.random() < spec.cancel_probability else None
        sreq = _turn_request(conv, priority, now, prompt, output, hashes, cancel_after=cancel)
        conv.turn += 1
        return sreq

    def answered(self, conv: Conversation, sreq: SimRequest) -> None:
        """The turn's answer becomes part of the conversation's history."""
        conv.history = sreq.prompt + sreq.output[: sreq.tokens_out]
        conv.history_hashes = sreq.hashes[: len(conv.history) // self.block_size]

    def think_time(self, conv: Conversation) -> float:
        return conv.rng.expovariate(1 / self.spec.think_time_s) if self.spec.think_time_s > 0 else 0.0


def _turn_request(
    conv: Conversation,
    priority: int,
    now: float,
    prompt: list[int],
    output: list[int],
    hashes: list[bytes],
    **details: Any,
) -> SimRequest:
    """The conversation's current turn as a request arriving `now`; `details`: SimRequest's optional fields."""
    return SimRequest(
        f"c{conv.cid}t{conv.turn}",
        conv.tier,
        conv.tenant,
        conv.user,
        priority,
        prompt,
        output,
        hashes,
        now,
        conversation=conv.cid,
        turn=conv.turn,
        **details,
    )


def block_keys(token_ids: list[int], block_size: int, start: list[bytes]) -> list[bytes]:
    """Prefix-cache keys for every full block of a token sequence, chained over the parent's key like the engine's
    (`prefix_block_hashes`), but with Python's tuple hash instead of BLAKE2: the simulator hands these keys to the
    engine (Request.block_hashes) and to the router (choose(hashes=...)), which only ever compare them. 64 bits: a
    run's million-odd keys collide with a chance of ~1e-7. The same tokens always give the same keys, in every
    process.
    `start`: the keys of the sequence's leading blocks, known already; `token_ids`: the tokens after them."""
    keys = list(start)
    parent = int.from_bytes(keys[-1], "little") if keys else 0
    for i in range(len(token_ids) // block_size):
        parent = hash((parent, *token_ids[i * block_size : (i + 1) * block_size])) & 0xFFFF_FFFF_FFFF_FFFF
        keys.append(parent.to_bytes(8, "little"))
    return keys


def _geometric(rng: random.Random, mean: float) -> int:
    """Turns of a chat: 1 + a geometric number of follow-ups, `mean` on average (at most 255)."""
    if mean <= 1:
        return 1
    return min(255, 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / mean)))


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, int(rng.lognormvariate(mu, sigma)))


def _cumulative(weights: list[float]):
    total = 0.0
    for w in weights:
        total += w
        yield total
