"""The engine's own options (the same names as vLLM's engine arguments where they exist) and their command-line
flags. The engine owns this module; it imports nothing above the engine."""

from __future__ import annotations

import argparse
import json
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# vLLM's names. auto: the model's dtype; fp8 (= fp8_e4m3): 3 mantissa bits, range +-448; fp8_e5m2: 2 bits, +-57344
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
QUANTIZATIONS = ("fp8", "int8")  # on-line weight quantization at load (model/quantized.py)
SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, under vLLM's --speculative-config keys: `ngram` proposes the tokens that followed the
    latest earlier occurrence of the sequence's last n tokens (prompt lookup, n from prompt_lookup_max down to
    prompt_lookup_min); `draft_model` runs `model`, a smaller checkpoint with the target's vocabulary, k times per
    step. Either way the target verifies every proposal in one forward pass, so the output is the target's own."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # the draft checkpoint (draft_model only)

    def __post_init__(self) -> None:
        if self.method == "draft":  # accepted for brevity; vLLM's name is draft_model
            object.__setattr__(self, "method", "draft_model")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method {self.method!r} is not supported; choose one of "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, "
                f"got {k!r}"
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got prompt_lookup_min={low!r}, prompt_lookup_max={high!r}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.method draft_model needs `model`, the draft checkpoint's folder")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config.model is for method draft_model; ngram takes no model")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str) -> SpeculativeConfig:
        """From a SpeculativeConfig, a mapping (LLM(speculative_config={...})) or JSON text (the flag)."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config is a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative_config key(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        if "model" in value and "method" not in value:  # as in vLLM: a model alone means a draft model
            value = {**value, "method": "draft_model"}
        return cls(**value)


def _speculative_flag(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto = the checkpoint's dtype; or float32 / bfloat16 / float16
    device: str = "auto"  # auto = cuda when present, else cpu
    max_model_len: int | None = None  # defaults to the model's context window
    block_size: int = 16
    # KV cache budget on CPU; None: what max_num_seqs x max_model_len can use, within a share of the available
    # memory (engine/memory.py)
    kv_cache_gib: float | None = field(default=None, metadata={"help": "default: auto, sized to the job"})
    kv_cache_dtype: str = field(default="auto", metadata={"choices": KV_CACHE_DTYPES})
    quantization: str | None = field(
        default=None,
        metadata={
            "choices": QUANTIZATIONS,
            "help": "quantize a full-precision checkpoint's linear weights to 8 bits at load, a scale per output "
            "channel (default: none; a quantized checkpoint loads as its config.json says)",
        },
    )
    gpu_memory_utilization: float = 0.9  # fraction of the GPU this engine may take: weights, activations, KV cache
    # host memory for swapped-out KV blocks, allocated at the first swap-out; None: as large as the KV cache, within
    # a share of the available memory
    swap_space_gib: float | None = field(default=None, metadata={"help": "default: auto, as large as the KV cache"})
    swap_threshold_tokens: int = 512  # preempted sequences this long are swapped, shorter ones recomputed
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    watermark: float = 0.01  # fraction of blocks kept free when admitting, headroom for running sequences
    enable_prefix_caching: bool = True
    skip_tokenizer_init: bool = False
    threads: int = 0  # PyTorch threads; 0 = auto (servers: every usable core but one; offline: PyTorch's default)
    engine_process: bool = True  # servers: the engine steps in its own process, not on a thread beside the HTTP loop
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "ranks the model is split across (heads, KV heads, MLP and vocabulary), one process each: "
            "gloo on CPU, NCCL with one GPU per rank (default: 1, no split)"
        },
    )
    speculative_config: SpeculativeConfig | None = field(
        default=None,
        metadata={
            "parse": _speculative_flag,
            "help": 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_max": 4} or {"method": "draft_model", "model": DIR, "num_speculative_tokens": 4} '
            "(default: off)",
        },
    )

    def __post_init__(self) -> None:
        if isinstance(self.tensor_parallel_size, bool) or not (
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1
        ):
            raise ValueError(
                f"tensor_parallel_size must be an integer of at least 1, got {self.tensor_parallel_size!r}"
            )
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; choose one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization {self.quantization!r} is not supported; choose one of {', '.join(QUANTIZATIONS)}"
            )

    @classmethod
    def from_options(cls, model: str, **options: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(model=model, **options)

    def resolved_device(self) -> torch.device:
        import torch  # here, so the gateway's configuration does not load PyTorch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


# A server's step budget: a new request waits for the step in flight, so shorter prefill steps cut the first token's
# tail under load; offline, the larger default's fewer steps win (docs/benchmarks/served_saturation.md).
SERVER_DEFAULTS: dict[str, Any] = {"max_num_batched_tokens": 1024}


def add_engine_arguments(
    parser: argparse.ArgumentParser, model_required: bool = True, defaults: dict[str, Any] | None = None
) -> None:
    """One --flag per EngineConfig field (underscores become dashes), with the field's type and default (or the
    one `defaults` gives it)."""
    hints = typing.get_type_hints(EngineConfig)
    defaults = defaults or {}
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        default = defaults.get(f.name, None if f.default is MISSING else f.default)
        if f.name == "model":
            parser.add_argument(flag, required=model_required, default=None, help="Hugging Face checkpoint folder")
        elif kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            parser.add_argument(
                flag,
                type=f.metadata.get("parse", base),
                default=default,
                choices=f.metadata.get("choices"),
                help=f.metadata.get("help", f"default: {default}"),
            )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})
