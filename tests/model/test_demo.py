"""The demo checkpoint: a complete, deterministic HF-format Llama folder that transformers can load."""

from __future__ import annotations

import filecmp
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tokenfleet.cli import main
from tokenfleet.model.demo import SIZES, weight_shapes, write_demo_checkpoint
from tokenfleet.model.tokenizer import Tokenizer

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_folder_has_every_file_and_a_consistent_config(demo_model_dir):
    assert sorted(p.name for p in demo_model_dir.iterdir()) == FILES
    config = read_json(demo_model_dir / "config.json")
    tok = Tokenizer.from_dir(demo_model_dir)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (
        config["hidden_size"],
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["intermediate_size"],
    ) == (64, 2, 4, 2, 176)
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert config["rope_theta"] == 10000 and config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is False and config["max_position_embeddings"] == 2048
    assert config["vocab_size"] == tok.vocab_size == 4096
    assert config["bos_token_id"] == tok.bos_token_id == tok.token_to_id("<|begin_of_text|>")
    assert config["eos_token_id"] == tok.eos_token_id == tok.token_to_id("<|end_of_text|>")
    assert read_json(demo_model_dir / "generation_config.json")["eos_token_id"] == [
        tok.token_to_id("<|end_of_text|>"),
        tok.token_to_id("<|im_end|>"),
    ]


def test_weights_use_hf_names_shapes_and_init(demo_model_dir):
    weights = load_file(demo_model_dir / "model.safetensors")
    config = read_json(demo_model_dir / "config.json")
    assert {name: tuple(t.shape) for name, t in weights.items()} == weight_shapes(SIZES["tiny"], config["vocab_size"])
    assert "model.layers.1.self_attn.k_proj.weight" in weights and "lm_head.weight" in weights
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)  # 2 kv heads x head_dim 16
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        if name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor)), name
        else:
            assert 0.015 < tensor.std().item() < 0.025 and abs(tensor.mean().item()) < 0.005, name
    assert not torch.equal(weights["model.embed_tokens.weight"], weights["lm_head.weight"])


def test_tokenizer_round_trips_training_text_and_unicode(demo_model_dir):
    from pydoc_data.topics import topics

    tok = Tokenizer.from_dir(demo_model_dir)
    text = topics["assert"][:2000] + " 😀 日本語"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2.5  # trained merges compress English text
    assert {tok.token_to_id(t) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>")} == {
        0,
        1,
        2,
        3,
    }
    assert tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == (
        "<|begin_of_text|><|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    )


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, demo_model_dir):
    again = write_demo_checkpoint(tmp_path / "again", size="tiny", seed=0)
    assert filecmp.cmpfiles(demo_model_dir, again, FILES, shallow=False)[0] == FILES
    other = write_demo_checkpoint(tmp_path / "other", size="tiny", seed=1)
    assert filecmp.cmp(demo_model_dir / "tokenizer.json", other / "tokenizer.json", shallow=False)
    assert not filecmp.cmp(demo_model_dir / "model.safetensors", other / "model.safetensors", shallow=False)


def test_size_table_parameter_counts():
    counts = {
        name: sum(torch.Size(s).numel() for s in weight_shapes(spec, 4096).values()) for name, spec in SIZES.items()
    }
    assert 0.5e6 < counts["tiny"] < 1.5e6
    assert 2.5e6 < counts["small"] < 6e6
    assert 20e6 < counts["medium"] < 35e6
    with pytest.raises(ValueError, match="unknown demo model size 'huge'"):
        write_demo_checkpoint("/nonexistent", size="huge")


def test_loads_and_runs_with_transformers(demo_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_model_dir).eval()
    hf_tok = AutoTokenizer.from_pretrained(demo_model_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    weights = load_file(demo_model_dir / "model.safetensors")
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in weights.items())
    ids = hf_tok("Hello world", return_tensors="pt").input_ids
    assert ids[0, 0].item() == hf_tok.bos_token_id == 0
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and torch.isfinite(logits).all()
    assert hf_tok.chat_template is not None


def test_cli_in_process(tmp_path, capsys):
    assert main(["demo-model", str(tmp_path / "m"), "--size", "tiny", "--seed", "3"]) == 0
    assert "tiny demo checkpoint" in capsys.readouterr().out
    assert read_json(tmp_path / "m" / "config.json")["hidden_size"] == 64
    with pytest.raises(SystemExit):
        main(["demo-model", str(tmp_path / "x"), "--size", "huge"])


def test_python_dash_m_demo_model_loads_with_transformers(tmp_path, demo_model_dir):
    out = tmp_path / "cli-model"
    result = subprocess.run(
        [sys.executable, "-m", "tokenfleet", "demo-model", str(out), "--size", "tiny"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    # a fresh process writes byte-identical files (tokenizer training is deterministic across processes)
    assert filecmp.cmpfiles(demo_model_dir, out, FILES, shallow=False)[0] == FILES
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 2
    assert AutoTokenizer.from_pretrained(out).decode([0, 1], skip_special_tokens=False) == (
        "<|begin_of_text|><|end_of_text|>"
    )
