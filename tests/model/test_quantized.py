"""8-bit weights: quantized checkpoints in each supported format, and on-line quantization of a full-precision
one, compute what the dequantized weights compute (transformers on a checkpoint holding them), hold about a quarter
of fp32's bytes, and every unsupported quantization is a clear error at start that names it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import SMALL_KV, load_reference, make_checkpoint
from tests.model.test_loader import check_matches_reference
from tests.quantized_checkpoints import FORMATS, write_online_reference, write_quantized
from tokenfleet import LLM, SamplingParams
from tokenfleet.engine.config import EngineConfig, add_engine_arguments, engine_config_from_args
from tokenfleet.model.loader import load_model
from tokenfleet.model.quantized import QuantizedLinear, linear_weight_bytes, unpack_int8


@pytest.fixture(scope="module")
def fp32_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("fp32") / "llama", "llama")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_checkpoint_matches_its_dequantized_reference(fp32_checkpoint: Path, tmp_path: Path, fmt: str):
    quantized, reference = write_quantized(fp32_checkpoint, tmp_path / fmt, fmt)
    check_matches_reference(quantized, load_reference(reference))


def test_quantized_qwen2_with_biases_matches_reference(tmp_path: Path):
    source = make_checkpoint(tmp_path / "qwen2", "qwen2")
    quantized, reference = write_quantized(source, tmp_path / "ct", "ct-int-channel")
    check_matches_reference(quantized, load_reference(reference))


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_online_quantization_matches_per_channel_reference(fp32_checkpoint: Path, tmp_path: Path, method: str):
    reference = write_online_reference(fp32_checkpoint, tmp_path / "reference", method)
    llm = check_matches_reference(fp32_checkpoint, load_reference(reference), quantization=method)
    kinds = {type(m) for m in llm.engine.model.layers[0].modules()}
    assert QuantizedLinear in kinds


def test_quantization_changes_the_output_a_little(fp32_checkpoint: Path):
    """The int8 model is not the fp32 one, and not far from it (these random weights, drawn with std 0.5, amplify
    rounding more than trained ones do): logits off by a few percent of their spread, mostly the same top-1."""
    full = load_model(fp32_checkpoint)
    quantized = load_model(fp32_checkpoint, quantization="int8")
    ids = torch.arange(3, 40)
    a, b = _logits(full, ids), _logits(quantized, ids)
    assert not torch.equal(a, b)
    assert (a - b).abs().mean() < 0.1 * a.std()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    from tokenfleet.commands.eval import sequence_logits

    return sequence_logits(model, ids.tolist())


@pytest.mark.parametrize("fmt", ["fp8-channel", "ct-pack-channel"])
def test_linear_weights_take_a_quarter_of_fp32(fp32_checkpoint: Path, tmp_path: Path, fmt: str):
    quantized, _ = write_quantized(fp32_checkpoint, tmp_path / fmt, fmt)
    full_bytes = linear_weight_bytes(load_model(fp32_checkpoint))
    model = load_model(quantized)
    weights = [m.weight for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(weights) == 4 * 2  # qkv, o, gate_up, down in each of 2 layers
    assert all(w.element_size() == 1 for w in weights)
    assert sum(w.numel() for w in weights) * 4 == full_bytes
    ratio = linear_weight_bytes(model) / full_bytes  # with the float32 scales, one per output channel
    assert 0.25 < ratio < 0.27


def test_online_quantization_takes_a_quarter_of_fp32(fp32_checkpoint: Path):
    full_bytes = linear_weight_bytes(load_model(fp32_checkpoint))
    assert 0.25 < linear_weight_bytes(load_model(fp32_checkpoint, quantization="fp8")) / full_bytes < 0.27


def test_unpack_reads_compressed_tensors_words():
    values = torch.tensor([[-128, -1, 0, 127, 5, 6, 7, 8]], dtype=torch.int8)
    # word 0: bytes 0x00, 0x7f, 0x80, 0xff (value + 128), lowest first
    words = torch.tensor([[0xFF807F00 - (1 << 32), 0x88878685 - (1 << 32)]], dtype=torch.int32)
    assert torch.equal(unpack_int8(words, (1, 8)), values)


def _with_quantization_config(source: Path, dest: Path, config: dict) -> Path:
    import shutil

    shutil.copytree(source, dest)
    raw = json.loads((dest / "config.json").read_text())
    raw["quantization_config"] = config
    (dest / "config.json").write_text(json.dumps(raw))
    return dest


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "awq"}, "quant_method 'awq'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size"),
        ({"quant_method": "compressed-tensors", "format": "marlin-24"}, "format 'marlin-24'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}
                },
            },
            "num_bits 4",
        ),
    ],
)
def test_unsupported_quantization_config_is_a_clear_error_at_start(
    fp32_checkpoint: Path, tmp_path: Path, config: dict, message: str
):
    path = _with_quantization_config(fp32_checkpoint, tmp_path / "bad", config)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), skip_tokenizer_init=True, **SMALL_KV)


def test_eight_bit_weights_without_quantization_config_are_an_error(fp32_checkpoint: Path, tmp_path: Path):
    quantized, _ = write_quantized(fp32_checkpoint, tmp_path / "fp8", "fp8-tensor")
    raw = json.loads((quantized / "config.json").read_text())
    del raw["quantization_config"]
    (quantized / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="no quantization_config"):
        load_model(quantized)


def test_weights_of_another_dtype_than_the_config_says_are_an_error(fp32_checkpoint: Path, tmp_path: Path):
    quantized, _ = write_quantized(fp32_checkpoint, tmp_path / "fp8", "fp8-channel")
    tensors = load_file(quantized / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].float()
    save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj.weight is stored in torch.float32"):
        load_model(quantized)


def test_missing_scales_are_an_error(fp32_checkpoint: Path, tmp_path: Path):
    quantized, _ = write_quantized(fp32_checkpoint, tmp_path / "ct", "ct-int-channel")
    tensors = load_file(quantized / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight_scale"]
    save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.weight_scale"):
        load_model(quantized)


def test_online_quantization_of_a_quantized_checkpoint_is_an_error(fp32_checkpoint: Path, tmp_path: Path):
    quantized, _ = write_quantized(fp32_checkpoint, tmp_path / "fp8", "fp8-tensor")
    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(quantized), skip_tokenizer_init=True, quantization="int8", **SMALL_KV)


def test_quantization_option_and_flag():
    import argparse

    with pytest.raises(ValueError, match="quantization 'int4'"):
        EngineConfig(model="m", quantization="int4")
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["--model", "m", "--quantization", "fp8"])).quantization == "fp8"
    assert engine_config_from_args(parser.parse_args(["--model", "m"])).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--quantization", "gptq"])


def test_bf16_checkpoint_quantized_online_computes_its_dequantized_bf16_weights(tmp_path: Path):
    source = make_checkpoint(tmp_path / "bf16", "qwen3", dtype=torch.bfloat16)
    reference = write_online_reference(source, tmp_path / "reference", "fp8")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    prompt = [{"prompt_token_ids": list(range(7, 30))}]
    quantized = LLM(str(source), skip_tokenizer_init=True, quantization="fp8", **SMALL_KV).generate(prompt, params)
    expected = LLM(str(reference), skip_tokenizer_init=True, **SMALL_KV).generate(prompt, params)
    assert quantized[0].token_ids == expected[0].token_ids
    assert [lp.logprob for lp in quantized[0].logprobs] == [lp.logprob for lp in expected[0].logprobs]
