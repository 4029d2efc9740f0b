"""Small random-weight Hugging Face checkpoints of each supported architecture, made with transformers."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.5,
    bos_token_id=1,
    eos_token_id=2,
)

# KV cache and swap space of an engine in a test: 10 MiB each (~1,300 16-token blocks of these models), enough for
# every test's requests, instead of the defaults' 2 GiB + 1 GiB, which each engine fills with zeros up front.
SMALL_KV = dict(kv_cache_gib=0.01, swap_space_gib=0.01)

ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama3-scaled": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(tie_word_embeddings=False, sliding_window=None, head_dim=16),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=32)),
}


def make_checkpoint(
    path: Path, arch: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides
) -> Path:
    import transformers

    config_name, model_name, extra = ARCHITECTURES[arch]
    config = getattr(transformers, config_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype)
    if arch in ("qwen2",):  # biases start at zero; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_reference(path: Path, dtype: torch.dtype = torch.float32):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos: generate exactly max tokens
    return model


def reference_greedy(model, prompt: list[int], max_new_tokens: int, cache=None) -> list[int]:
    """transformers' greedy generate on the model's device; with `cache`, that KV cache (e.g. one that rounds K and V
    through 8 bits as an FP8 cache does)."""
    ids = torch.tensor([prompt], device=model.device)
    # transformers 5 renamed generate's past_key_values to cache; the old name works (with a warning) in 4 and 5
    with torch.no_grad(), warnings.catch_warnings(action="ignore", category=FutureWarning):
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **({} if cache is None else {"past_key_values": cache}),
        )
    return out[0, len(prompt) :].tolist()
