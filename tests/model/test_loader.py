"""load_model: sharded and tied checkpoints match transformers, dtypes are kept or cast, and every broken checkpoint
fails with a clear exception that names the problem."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.checkpoints import SMALL_KV, load_reference, make_checkpoint, reference_greedy
from tokenfleet import LLM, SamplingParams
from tokenfleet.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tokenfleet.model.loader import load_model


def prompts(count: int = 3, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(rng.randint(3, 30))] for _ in range(count)]


def check_matches_reference(path: Path, reference, max_tokens: int = 8, **options) -> LLM:
    """Greedy tokens equal transformers' generate, and each token's logprobs equal transformers' logits."""
    llm = LLM(str(path), skip_tokenizer_init=True, **SMALL_KV, **options)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    cases = prompts()
    outputs = llm.generate([{"prompt_token_ids": p} for p in cases], params)
    for prompt, out in zip(cases, outputs):
        assert out.token_ids == reference_greedy(reference, prompt, max_tokens)
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + out.token_ids[:-1]])).logits[0].float()
        ref_lsm = torch.log_softmax(logits[len(prompt) - 1 :], dim=-1)
        assert len(out.logprobs) == max_tokens
        for row, lp in zip(ref_lsm, out.logprobs):
            assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
            top_ids = [t for t, _ in lp.top]
            assert torch.allclose(torch.tensor([v for _, v in lp.top]), row[top_ids], atol=1e-4)
    return llm


def save_hf(path: Path, arch_config: str, arch_model: str, dtype=torch.float32, seed: int = 0, **kw) -> Path:
    import transformers

    from tests.checkpoints import COMMON

    config = getattr(transformers, arch_config)(**{**COMMON, **kw})
    torch.manual_seed(seed)
    model = getattr(transformers, arch_model)(config).to(dtype)
    model.save_pretrained(path, max_shard_size="20KB")
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def broken(llama_dir, tmp_path) -> Path:
    """A private copy of the small Llama checkpoint, free to damage."""
    return Path(shutil.copytree(llama_dir, tmp_path / "ckpt"))


def weights_file(path: Path) -> Path:
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == 1
    return files[0]


def edit_weights(path: Path, edit) -> None:
    file = weights_file(path)
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), {"format": "pt"})


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


# --- sharded checkpoints ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch",
    [
        ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
        ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    ],
    ids=["llama", "qwen2-tied"],
)
def test_sharded_checkpoint_matches_transformers(tmp_path, arch):
    config_name, model_name, extra = arch
    path = save_hf(tmp_path / "sharded", config_name, model_name, **extra)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3, "the checkpoint should be split over several shards"
    assert sorted(p.name for p in path.glob("*.safetensors")) == shards
    check_matches_reference(path, load_reference(path))


def test_sharded_checkpoint_loads_every_shard(tmp_path):
    path = save_hf(tmp_path / "sharded", "LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=False)
    model = load_model(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    ours = dict(model.named_parameters())
    for name, shard in index["weight_map"].items():
        with safe_open(str(path / shard), framework="pt") as f:
            tensor = f.get_tensor(name)
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
            continue  # fused; their values are covered by the reference comparison
        assert torch.equal(ours[name.removeprefix("model.")].data, tensor), name


def test_sharded_checkpoint_with_stray_consolidated_file_uses_the_index(tmp_path):
    """Only the files the index lists are read (a leftover consolidated file with other weights is ignored)."""
    path = save_hf(tmp_path / "sharded", "LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=False)
    stray = {"model.embed_tokens.weight": torch.zeros(384, 64)}
    save_file(stray, str(path / "model.safetensors"), {"format": "pt"})
    model = load_model(path)
    assert model.embed_tokens.weight.abs().sum() > 0


# --- tied / untied embeddings ----------------------------------------------------------------------------------------


def test_tied_embeddings_with_stored_lm_head(tmp_path):
    path = make_checkpoint(tmp_path / "qwen2", "qwen2")  # tie_word_embeddings=True
    reference = load_reference(path)
    names = load_file(str(weights_file(path)))
    if "lm_head.weight" not in names:  # store the (identical) copy that some checkpoints carry anyway

        def add_head(t):
            t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

        edit_weights(path, add_head)
    assert "lm_head.weight" in load_file(str(weights_file(path)))
    model = load_model(path)
    assert model.lm_head is None
    check_matches_reference(path, reference)


def test_tied_embeddings_without_lm_head(tmp_path):
    path = make_checkpoint(tmp_path / "qwen2", "qwen2")
    edit_weights(path, lambda t: t.pop("lm_head.weight", None))
    model = load_model(path)
    assert model.lm_head is None


def test_untied_without_lm_head_names_the_missing_weight(broken):
    edit_weights(broken, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing.*lm_head\.weight"):
        load_model(broken)


# --- dtypes ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_checkpoints_load_in_their_dtype_and_cast(tmp_path, dtype):
    path = make_checkpoint(tmp_path / "half", "llama", dtype=dtype)
    assert ModelConfig.from_dir(path).dtype == dtype
    stored = load_file(str(weights_file(path)))
    assert stored["model.norm.weight"].dtype == dtype

    model = load_model(path)  # auto: the checkpoint's dtype
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert torch.equal(model.embed_tokens.weight, stored["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"])

    as_fp32 = load_model(path, dtype=torch.float32)
    assert {p.dtype for p in as_fp32.parameters()} == {torch.float32}
    assert torch.equal(as_fp32.embed_tokens.weight, stored["model.embed_tokens.weight"].float())
    q = stored["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(as_fp32.layers[0].self_attn.qkv_proj.weight[: q.shape[0]], q.float())

    auto = LLM(str(path), skip_tokenizer_init=True, **SMALL_KV)  # engine dtype="auto"
    assert next(auto.engine.model.parameters()).dtype == dtype
    cast = LLM(str(path), skip_tokenizer_init=True, dtype="float32", **SMALL_KV)
    assert next(cast.engine.model.parameters()).dtype == torch.float32
    assert cast.engine.runner.kv_cache.dtype == torch.float32
    # the float32 cast of a half checkpoint computes the same thing transformers does in float32
    reference = load_reference(path, dtype=torch.float32)
    prompt = prompts(1, seed=5)[0]
    out = cast.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == reference_greedy(reference, prompt, 6)


def test_bad_dtype_name():
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        from tokenfleet.model.config import parse_dtype

        parse_dtype("int8")


# --- errors ----------------------------------------------------------------------------------------------------------


def test_missing_folder(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model.*does not exist"):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(missing), skip_tokenizer_init=True)


def test_missing_config(broken):
    (broken / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(broken)


def test_config_not_json(broken):
    (broken / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_model(broken)


def test_unsupported_architecture(broken):
    edit_config(broken, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'") as info:
        load_model(broken)
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(info.value)


def test_no_safetensors(broken):
    weights_file(broken).rename(broken / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(broken)


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage header"])
def test_corrupt_safetensors(broken, damage):
    file = weights_file(broken)
    data = file.read_bytes()
    if damage == "truncated":
        file.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        file.write_bytes(b"")
    else:
        file.write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(ValueError, match=f"cannot read weights file .*{file.name}"):
        load_model(broken)


def test_index_lists_missing_shard(tmp_path):
    path = save_hf(tmp_path / "sharded", "LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=False)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (path / gone).unlink()
    with pytest.raises(FileNotFoundError, match=f"missing: .*{gone}"):
        load_model(path)


def test_index_not_json(tmp_path):
    path = save_hf(tmp_path / "sharded", "LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=False)
    (path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid safetensors index"):
        load_model(path)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.mlp.down_proj.weight",  # plain
        "model.layers.1.self_attn.k_proj.weight",  # a slice of the fused qkv
        "model.layers.0.mlp.up_proj.weight",  # a slice of the fused gate_up
        "model.embed_tokens.weight",
    ],
)
def test_wrong_shape(broken, name):
    def shrink(t):
        t[name] = t[name][:, :-1].contiguous()

    edit_weights(broken, shrink)
    with pytest.raises(ValueError, match=rf"{name}.*shape"):
        load_model(broken)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.post_attention_layernorm.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.norm.weight",
    ],
)
def test_missing_weight(broken, name):
    edit_weights(broken, lambda t: t.pop(name))
    with pytest.raises(ValueError, match="missing") as info:
        load_model(broken)
    assert name in str(info.value)


def test_many_missing_weights_are_summarised(broken):
    edit_weights(broken, lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.")])
    with pytest.raises(ValueError, match=r"missing weights for: .* and \d+ more"):
        load_model(broken)


@pytest.mark.parametrize("style", ["rope_scaling.rope_type", "rope_scaling.type", "rope_parameters"])
def test_unsupported_rope_scaling(broken, style):
    key, _, field = style.partition(".")
    scaling = {field or "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    if key == "rope_parameters":
        scaling["rope_theta"] = 10000.0
    edit_config(broken, **{"rope_scaling": None, "rope_parameters": None, key: scaling})
    with pytest.raises(ValueError, match="unsupported rope scaling 'yarn'"):
        load_model(broken)
    with pytest.raises(ValueError, match="yarn"):
        LLM(str(broken), skip_tokenizer_init=True, **SMALL_KV)


def test_unexpected_extra_weight_is_ignored(broken, caplog):
    edit_weights(broken, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    edit_weights(broken, lambda t: t.__setitem__("model.vision_tower.weight", torch.ones(2)))
    model = load_model(broken)
    assert model.norm.weight.shape == (64,)
    assert "model.vision_tower.weight" in caplog.text
