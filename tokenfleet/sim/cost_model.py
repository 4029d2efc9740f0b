"""The model's forward pass replaced by its duration: a roofline of one engine step.

A step computes some prefill tokens and some decode tokens. Its time is
    overhead + per_sequence x sequences + combine(compute, memory) + all-reduce + swap copies
where compute = 2 x params x tokens / (peak x MFU x TP) + attention FLOPs / (peak x attention MFU x TP) — what
prefill is bound by — and memory = (weight bytes + KV bytes read) / (TP x HBM bandwidth x efficiency) — what
decode is bound by. On a GPU the two overlap (combine = max); a calibration on a CPU may fit combine = sum.
Everything reduces to a handful of coefficients (StepCoefficients), which a calibration can also fit directly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from tokenfleet.sim.hardware import Hardware
from tokenfleet.sim.levers import Speculation
from tokenfleet.sim.models import ModelShape
from tokenfleet.sim.numbers import is_finite

ACTIVATION_BYTES = 2  # all-reduce payloads are FP16/BF16 activations
PCIE_BYTES_PER_S = 25e9  # host <-> device swap copies


@dataclass
class StepBatch:
    """What one step computes, summed over its chunks."""

    prefill_tokens: int = 0
    attention_pairs: float = 0.0  # sum over computed tokens of the context each attends to (query-key pairs)
    kv_tokens_read: int = 0  # cached tokens whose K and V the step reads
    sequences: int = 0
    decode_sequences: int = 0
    swapped_blocks: int = 0
    decode_context: int = 0  # sum over decode chunks of the tokens before the new one (speculation re-prices them)

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_sequences

    def add_chunk(self, start: int, n: int) -> None:
        """A chunk computing n tokens at positions start..start+n-1 (n == 1 and start > 0: a decode)."""
        self.sequences += 1
        if n == 1:
            self.decode_sequences += 1
            self.decode_context += start
        else:
            self.prefill_tokens += n
        self.attention_pairs += n * start + n * (n + 1) / 2
        self.kv_tokens_read += start + n


@dataclass(frozen=True)
class StepCoefficients:
    overhead_s: float
    per_sequence_s: float
    per_token_s: float  # linear-layer compute per token
    per_attention_pair_s: float
    weights_s: float  # reading the weights once
    per_kv_token_s: float  # reading one token's K and V
    allreduce_per_step_s: float = 0.0  # latency of a step's all-reduces (0 without tensor parallelism)
    allreduce_per_token_s: float = 0.0
    swap_per_block_s: float = 0.0
    combine: str = "max"  # "max": compute and memory overlap (GPU); "sum": they do not

    def __post_init__(self) -> None:
        if self.combine not in ("max", "sum"):
            raise ValueError(f"combine must be max or sum, got {self.combine!r}")
        bad = [k for k, v in asdict(self).items() if k != "combine" and not (is_finite(v) and v >= 0)]
        if bad:
            raise ValueError(f"cost coefficients must be finite numbers >= 0: {', '.join(bad)}")


class CostModel:
    def __init__(self, coefficients: StepCoefficients) -> None:
        self.c = coefficients

    def step_time(self, batch: StepBatch) -> float:
        c = self.c
        compute = c.per_token_s * batch.tokens + c.per_attention_pair_s * batch.attention_pairs
        memory = c.weights_s + c.per_kv_token_s * batch.kv_tokens_read
        core = max(compute, memory) if c.combine == "max" else compute + memory
        return (
            c.overhead_s
            + c.per_sequence_s * batch.sequences
            + core
            + c.allreduce_per_step_s
            + c.allreduce_per_token_s * batch.tokens
            + c.swap_per_block_s * batch.swapped_blocks
        )

    def decode_time(self, sequences: int, contexts: int) -> float:
        """step_time of a step of `sequences` decodes attending to `contexts` tokens in all (the hot path)."""
        c = self.c
        compute = c.per_token_s * sequences + c.per_attention_pair_s * contexts
        memory = c.weights_s + c.per_kv_token_s * contexts
        core = (compute if compute > memory else memory) if c.combine == "max" else compute + memory
        return (
            c.overhead_s
            + c.per_sequence_s * sequences
            + core
            + c.allreduce_per_step_s
            + c.allreduce_per_token_s * sequences
        )

    def decode_times(self, sequences: int, contexts: int, growth: int, count: int) -> list[float]:
        """decode_time(sequences, contexts + k x growth) for k = 0 .. count - 1: the steps of a run of decodes
        (the same arithmetic, so the same floats, as one call per step)."""
        c = self.c
        fixed = c.overhead_s + c.per_sequence_s * sequences
        per_token, pair, weights, kv = c.per_token_s * sequences, c.per_attention_pair_s, c.weights_s, c.per_kv_token_s
        tail = c.allreduce_per_step_s
        allreduce = c.allreduce_per_token_s * sequences
        use_max = c.combine == "max"
        times = []
        for k in range(count):
            ctx = contexts + k * growth
            compute = per_token + pair * ctx
            memory = weights + kv * ctx
            core = (compute if compute > memory else memory) if use_max else compute + memory
            times.append(fixed + core + tail + allreduce)
        return times

    def decode_step_time(self, batch_size: int, context: int) -> float:
        """One all-decode step: batch_size sequences, each with `context` tokens before the new one."""
        batch = StepBatch()
        for _ in range(batch_size):
            batch.add_chunk(context, 1)
        return self.step_time(batch)

    def prefill_time(self, tokens: int) -> float:
        batch = StepBatch()
        batch.add_chunk(0, tokens)
        return self.step_time(batch)


class SpeculativeCostModel(CostModel):
    """Steps with speculative decoding. Each decode becomes a verifying chunk of k + 1 rows (its last token and k
    proposals) that yields `mean_accepted_length` (L) tokens on average. The simulated replica still advances a
    decode by one token a step, so a step is priced at the verifying step's time scaled by the progress it stands
    for: the real step makes p + d x L tokens of progress (p prefill tokens, d decodes), the simulated one p + d.
    An all-decode step costs the verifying step over L: the mean inter-token latency is the engine's, the bursts
    of L tokens are spread evenly. The proposer's own work (an n-gram lookup, a draft model's passes) is not
    priced."""

    def __init__(self, coefficients: StepCoefficients, speculation: Speculation) -> None:
        super().__init__(coefficients)
        self.k = speculation.num_speculative_tokens
        self.accepted = speculation.mean_accepted_length

    def verifying_batch(self, batch: StepBatch) -> StepBatch:
        """`batch` with each decode turned into k + 1 rows attending to its context and to each other."""
        k, d = self.k, batch.decode_sequences
        return replace(
            batch,
            prefill_tokens=batch.prefill_tokens + d * (k + 1),
            decode_sequences=0,
            attention_pairs=batch.attention_pairs + k * batch.decode_context + d * ((k + 1) * (k + 2) / 2 - 1),
            kv_tokens_read=batch.kv_tokens_read + k * d,
        )

    def step_time(self, batch: StepBatch) -> float:
        d, p = batch.decode_sequences, batch.prefill_tokens
        if d == 0:
            return super().step_time(batch)
        return super().step_time(self.verifying_batch(batch)) * (p + d) / (p + d * self.accepted)

    def decode_time(self, sequences: int, contexts: int) -> float:
        """step_time of `sequences` decodes attending to `contexts` tokens in all, inlined (the hot path)."""
        c, k, d = self.c, self.k, sequences
        rows = d * (k + 1)
        pairs = contexts + k * (contexts - d) + d * ((k + 1) * (k + 2) / 2 - 1)
        compute = c.per_token_s * rows + c.per_attention_pair_s * pairs
        memory = c.weights_s + c.per_kv_token_s * (contexts + k * d)
        core = (compute if compute > memory else memory) if c.combine == "max" else compute + memory
        verify = c.overhead_s + c.per_sequence_s * d + core + c.allreduce_per_step_s + c.allreduce_per_token_s * rows
        return verify / self.accepted

    def decode_times(self, sequences: int, contexts: int, growth: int, count: int) -> list[float]:
        return [self.decode_time(sequences, contexts + k * growth) for k in range(count)]


def roofline(
    model: ModelShape,
    hw: Hardware,
    weight_dtype: str,
    kv_dtype: str,
    tp: int,
    block_size: int = 16,
    kv_token_bytes: float | None = None,
) -> StepCoefficients:
    """The coefficients of `model` on `tp` GPUs of kind `hw`, from peak rates and efficiencies (`kv_token_bytes`:
    a measured KV size per token instead of the dtype's)."""
    flops = hw.flops(weight_dtype) * tp
    bandwidth = hw.hbm_bytes_per_s * hw.bandwidth_efficiency * tp
    attention_flops_per_pair = 4 * model.num_layers * model.num_heads * model.head_dim  # QK^T and PV
    allreduces = 2 * model.num_layers  # after attention and after the MLP
    ring = 2 * (tp - 1) / tp  # bytes a ring all-reduce moves per byte of payload
    per_token_payload = model.hidden_size * ACTIVATION_BYTES * ring
    kv_token = model.kv_bytes_per_token(kv_dtype) if kv_token_bytes is None else kv_token_bytes
    return StepCoefficients(
        overhead_s=hw.step_overhead_s,
        per_sequence_s=hw.per_sequence_s,
        per_token_s=2 * model.params / (flops * hw.mfu),
        per_attention_pair_s=attention_flops_per_pair / (flops * hw.attention_mfu),
        weights_s=model.weight_bytes(weight_dtype) / bandwidth,
        per_kv_token_s=kv_token / bandwidth,
        allreduce_per_step_s=allreduces * hw.allreduce_latency_s if tp > 1 else 0.0,
        allreduce_per_token_s=(
            allreduces * per_token_payload / (hw.link_bytes_per_s * hw.link_efficiency) if tp > 1 else 0.0
        ),
        swap_per_block_s=block_size * kv_token / PCIE_BYTES_PER_S,
        combine="max",
    )


def kv_cache_blocks(
    model: ModelShape,
    hw: Hardware,
    weight_dtype: str,
    kv_dtype: str,
    tp: int,
    block_size: int,
    kv_token_bytes: float | None = None,
) -> int:
    """Blocks of KV cache left on the replica's GPUs after the weights and activations; raises when the model
    does not fit at this tensor-parallel degree (`kv_token_bytes`: a measured KV size per token)."""
    check_tp(model, hw, tp)
    usable = tp * (hw.memory_bytes * hw.memory_utilization - hw.activation_reserve_bytes)
    weights = model.weight_bytes(weight_dtype)
    free = usable - weights
    block_bytes = block_size * (model.kv_bytes_per_token(kv_dtype) if kv_token_bytes is None else kv_token_bytes)
    one_sequence = -(-model.max_model_len // block_size)
    blocks = int(free // block_bytes) if free > 0 else 0
    if blocks < one_sequence:
        raise ValueError(
            f"{model.name} in {weight_dtype} ({weights / 1e9:.0f} GB of weights) does not fit on {tp} x "
            f"{hw.name} ({usable / 1e9:.0f} GB usable): {max(blocks, 0)} KV blocks left, one "
            f"{model.max_model_len}-token sequence needs {one_sequence}; raise tensor_parallel or use fp8"
        )
    return blocks


def check_tp(model: ModelShape, hw: Hardware, tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or tp & (tp - 1):
        raise ValueError(f"tensor_parallel must be a power of two >= 1, got {tp!r}")
    if tp > hw.max_tp:
        raise ValueError(f"tensor_parallel {tp} is more than the {hw.max_tp} GPUs of one {hw.name} node")
    # each GPU holds whole KV heads (kv_cache_blocks splits the KV cache over the GPUs; replicated heads are not
    # modelled), so tensor_parallel may not exceed num_kv_heads
    if model.num_heads % tp or model.num_kv_heads % tp:
        raise ValueError(
            f"{model.name}: {model.num_heads} attention heads / {model.num_kv_heads} KV heads do not "
            f"split over tensor_parallel {tp} (it must divide both)"
        )
