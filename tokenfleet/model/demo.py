"""Write a small, randomly initialised Llama checkpoint in Hugging Face format.

A fresh machine has no model and cannot download one, so tests, benchmarks and demos use this instead. Everything is
built locally: the byte-level BPE tokenizer is trained on the English documentation that ships with Python
(`pydoc_data.topics`) and the weights come from a seeded torch generator, so the same size and seed always give
byte-identical files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, IM_START, IM_END]  # ids 0..3, in this order
MAX_POSITIONS = 2048

# ChatML with a leading BOS; content may be a string or a list of OpenAI-style {"type": "text"} parts.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('Unsupported chat role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- if message['content'] is string %}"
    "{%- set content = message['content'] %}"
    "{%- else %}"
    "{%- set ns = namespace(text='') %}"
    "{%- for part in message['content'] if part['type'] == 'text' %}"
    "{%- set ns.text = ns.text + part['text'] %}"
    "{%- endfor %}"
    "{%- set content = ns.text %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class DemoSize:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 4096  # target for tokenizer training; the trained size is what the config records

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SIZES: dict[str, DemoSize] = {
    "tiny": DemoSize(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=176),
    "small": DemoSize(hidden_size=192, num_layers=4, num_heads=6, num_kv_heads=2, intermediate_size=512),
    "medium": DemoSize(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408),
}


def write_demo_checkpoint(path: str | Path, size: str = "small", seed: int = 0) -> Path:
    """Write a complete HF-format LlamaForCausalLM checkpoint folder to `path` and return it."""
    if size not in SIZES:
        raise ValueError(f"unknown demo model size {size!r}; choose one of {sorted(SIZES)}")
    spec = SIZES[size]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    config = model_config(spec, tokenizer.get_vocab_size(with_added_tokens=True))
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config())
    _write_json(out / "tokenizer_config.json", tokenizer_config())
    _write_json(out / "special_tokens_map.json", {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN})
    save_file(random_weights(spec, config["vocab_size"], seed), str(out / "model.safetensors"), {"format": "pt"})
    return out


def training_corpus() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def train_tokenizer(vocab_size: int = 4096) -> BackendTokenizer:
    """Byte-level BPE (GPT-2 / Llama 3 style) trained on the pydoc topics; BOS is prepended on encode."""
    tokenizer = BackendTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, tokenizer.token_to_id(BOS_TOKEN))],
            ),
        ]
    )
    return tokenizer


def _token_ids() -> dict[str, int]:
    return {token: index for index, token in enumerate(SPECIAL_TOKENS)}


def tokenizer_config() -> dict[str, Any]:
    ids = _token_ids()
    added = {
        str(ids[token]): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }


def generation_config() -> dict[str, Any]:
    ids = _token_ids()
    return {"bos_token_id": ids[BOS_TOKEN], "eos_token_id": [ids[EOS_TOKEN], ids[IM_END]]}


def model_config(spec: DemoSize, vocab_size: int) -> dict[str, Any]:
    ids = _token_ids()
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }


def weight_shapes(spec: DemoSize, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint with its shape, in a fixed order (the order random values are drawn in)."""
    hidden, kv_dim = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, hidden)}
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}"
        shapes.update(
            {
                f"{prefix}.input_layernorm.weight": (hidden,),
                f"{prefix}.self_attn.q_proj.weight": (spec.num_heads * spec.head_dim, hidden),
                f"{prefix}.self_attn.k_proj.weight": (kv_dim, hidden),
                f"{prefix}.self_attn.v_proj.weight": (kv_dim, hidden),
                f"{prefix}.self_attn.o_proj.weight": (hidden, spec.num_heads * spec.head_dim),
                f"{prefix}.post_attention_layernorm.weight": (hidden,),
                f"{prefix}.mlp.gate_proj.weight": (spec.intermediate_size, hidden),
                f"{prefix}.mlp.up_proj.weight": (spec.intermediate_size, hidden),
                f"{prefix}.mlp.down_proj.weight": (hidden, spec.intermediate_size),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab_size, hidden)
    return shapes


def random_weights(spec: DemoSize, vocab_size: int, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(spec, vocab_size).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.float32)
        else:
            weights[name] = torch.randn(shape, generator=generator, dtype=torch.float32) * std
    return weights


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
