"""The engine's levers as the simulator prices them, from the engine's own measurements (issue 19).

Speculative decoding: a verifying step computes k + 1 rows for each decoding sequence (its last token and k
proposals) and yields, on average, the measured mean accepted length of tokens per sequence
(docs/benchmarks/speculative.json, bench/speculative.py). An FP8 KV cache: its bytes per token are the 16-bit
cache's times the measured ratio of the tokens each fits in the same budget (docs/benchmarks/kv_capacity.json,
bench/kv_capacity.py). Both are off unless a config's `levers:` section asks for them, so configs without it give
the same report as before.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

MEASUREMENTS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"  # the repository's benchmark results
SPECULATIVE_RESULTS = "speculative.json"
KV_CAPACITY_RESULTS = "kv_capacity.json"
SPECULATIVE_METHODS = ("ngram", "draft")  # the prefixes of bench/speculative.py's row names
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class Speculation:
    """k proposals per decoding sequence, of which a verifying step keeps mean_accepted_length - 1 on average."""

    num_speculative_tokens: int
    mean_accepted_length: float  # tokens a verifying step yields per sequence: 1 + accepted proposals
    source: str  # where the numbers come from, for the report

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be a whole number in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        if not 1.0 <= self.mean_accepted_length <= k + 1:
            raise ValueError(
                f"mean_accepted_length must be in [1, num_speculative_tokens + 1 = {k + 1}], "
                f"got {self.mean_accepted_length!r}"
            )

    @classmethod
    def from_acceptance_rate(cls, k: int, rate: float, source: str) -> Speculation:
        """Each proposal accepted with probability `rate`, independently, until the first rejection:
        E[accepted] = rate + rate^2 + ... + rate^k."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"acceptance_rate must be in [0, 1], got {rate!r}")
        return cls(k, 1.0 + sum(rate**i for i in range(1, k + 1)), source)


@dataclass(frozen=True)
class MeasuredSpeculation:
    """One speculation method's row of bench/speculative.py: what the simulator reads, and what it is checked on."""

    method: str
    speculation: Speculation
    acceptance_rate: float
    itl_speedup: dict[int, float]  # batch size -> median ITL without speculation / with it


@dataclass(frozen=True)
class MeasuredKVCapacity:
    """Tokens one engine's KV cache holds in the same budget, by model dtype and kv_cache_dtype."""

    budget_bytes: int
    tokens: dict[tuple[str, str], int]  # (dtype, kv_cache_dtype) -> tokens that fit
    source: str

    def fp8_bytes_ratio(self) -> float:
        """Bytes per token of an FP8 cache over a 16-bit one: the 16-bit cache's tokens over the FP8 cache's."""
        try:
            return self.tokens[("bfloat16", "auto")] / self.tokens[("bfloat16", "fp8_e4m3")]
        except KeyError:
            raise ValueError(f"{self.source} has no bfloat16 rows with kv_cache_dtype auto and fp8_e4m3") from None


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise ValueError(f"no measurements at {path} (run the benchmark that writes it, or give levers.measurements)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def measured_speculation(folder: Path, method: str) -> MeasuredSpeculation:
    """The tokenfleet rows of `method` (ngram or draft) in speculative.json: medians over runs and batch sizes
    (acceptance does not depend on the batch)."""
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"levers.speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
    path = folder / SPECULATIVE_RESULTS
    data = _read_json(path)
    rows = [r for r in data.get("rows", []) if r.get("engine", "tokenfleet") == "tokenfleet"]
    chosen = [r for r in rows if str(r["method"]).startswith(method)]
    plain = {r["batch"]: _median(r, "itl_ms") for r in rows if r["method"] == "none"}
    if not chosen:
        raise ValueError(f"{path} has no {method} rows")
    runs = [run for r in chosen for run in r["runs"] if run.get("mean_accepted_length") is not None]
    speedup = {r["batch"]: plain[r["batch"]] / _median(r, "itl_ms") for r in chosen if r["batch"] in plain}
    return MeasuredSpeculation(
        method,
        Speculation(
            int(data["args"]["k"]),
            statistics.median(run["mean_accepted_length"] for run in runs),
            f"{path.name} ({method})",
        ),
        statistics.median(run["acceptance_rate"] for run in runs),
        speedup,
    )


def _median(row: dict, name: str) -> float:
    return statistics.median(run[name] for run in row["runs"])


def measured_kv_capacity(folder: Path) -> MeasuredKVCapacity:
    path = folder / KV_CAPACITY_RESULTS
    data = _read_json(path)
    tokens = {
        (r["dtype"], r["kv_cache_dtype"]): int(r["kv_cache_tokens"])
        for r in data.get("rows", [])
        if r.get("engine") == "tokenfleet"
    }
    return MeasuredKVCapacity(int(data["budget_bytes"]), tokens, path.name)
