"""`tokenfleet eval`, the evaluation gate: its logits are the model's (transformers' on the same checkpoint), an
int8 build of a checkpoint passes a loose KL / agreement gate against it and a different model fails it, with the
exit codes a deploy pipeline reads."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoints import load_reference, make_checkpoint
from tests.quantized_checkpoints import write_quantized
from tokenfleet.cli import main
from tokenfleet.commands.eval import corpus_sequences, evaluate, sequence_logits
from tokenfleet.model.demo import write_demo_checkpoint
from tokenfleet.model.loader import load_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    fp32 = make_checkpoint(root / "fp32", "llama", seed=0)
    int8, _ = write_quantized(fp32, root / "int8", "ct-int-channel")
    other = make_checkpoint(root / "other", "llama", seed=1)
    return {"fp32": fp32, "int8": int8, "other": other}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenfleet", "eval", *args], capture_output=True, text=True, timeout=300
    )


def test_sequence_logits_are_the_models(checkpoints):
    ids = list(range(5, 60))
    ours = sequence_logits(load_model(checkpoints["fp32"]), ids)
    with torch.no_grad():
        theirs = load_reference(checkpoints["fp32"])(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_a_model_against_itself_agrees_fully(checkpoints):
    model = load_model(checkpoints["fp32"])
    sequences = corpus_sequences(checkpoints["fp32"], model.config.vocab_size, "")
    result = evaluate(model, model, sequences)
    assert result.tokens == sum(len(s) - 1 for s in sequences)
    assert result.mean_kl == pytest.approx(0.0, abs=1e-6)
    assert result.top1_agreement == 1.0
    assert result.perplexity == pytest.approx(result.reference_perplexity)


def test_perplexity_is_the_mean_negative_log_likelihood(checkpoints):
    model = load_model(checkpoints["fp32"])
    ids = list(range(10, 50))
    logp = torch.log_softmax(sequence_logits(model, ids)[:-1], dim=-1)
    nll = -sum(logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)) / (len(ids) - 1)
    assert evaluate(model, None, [ids]).perplexity == pytest.approx(math.exp(nll), rel=1e-5)


def test_int8_build_passes_the_gate(checkpoints):
    done = run_cli(
        "--model", str(checkpoints["int8"]), "--reference", str(checkpoints["fp32"]),
        "--max-kl", "0.2", "--min-agreement", "0.7",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "eval: 8/8 sequences, 1016 tokens" in done.stderr  # the progress line
    kl = float(done.stdout.split("mean KL(ref || model):")[1].split()[0])
    assert 0 < kl < 0.2
    assert done.stdout.strip().endswith("PASS")


def test_a_different_model_fails_the_gate(checkpoints):
    done = run_cli("--model", str(checkpoints["other"]), "--reference", str(checkpoints["fp32"]), "--max-kl", "0.2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL: mean KL divergence" in done.stdout
    assert done.stdout.strip().endswith("FAIL")


def test_online_quantization_is_evaluated_in_process(checkpoints, capsys):
    fp32 = str(checkpoints["fp32"])
    assert main(["eval", "--model", fp32, "--quantization", "int8", "--reference", fp32, "--max-kl", "0.2"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_a_tokenized_corpus_when_the_checkpoint_has_a_tokenizer(tmp_path: Path):
    path = write_demo_checkpoint(tmp_path / "demo", size="tiny")
    model = load_model(path)
    sequences = corpus_sequences(path, model.config.vocab_size, "The river rose slowly through the night. " * 20)
    assert len(sequences) >= 2 and all(1 < len(s) <= 128 for s in sequences)
    assert evaluate(model, None, sequences).perplexity > 1


def test_thresholds_without_a_reference_are_a_usage_error(checkpoints, capsys):
    assert main(["eval", "--model", str(checkpoints["fp32"]), "--max-kl", "0.1"]) == 2
    assert "need --reference" in capsys.readouterr().err


def test_a_reference_with_another_vocabulary_is_an_error(checkpoints, tmp_path: Path, capsys):
    small_vocab = make_checkpoint(tmp_path / "small", "llama", vocab_size=256)
    assert main(["eval", "--model", str(checkpoints["fp32"]), "--reference", str(small_vocab)]) == 2
    assert "vocabulary (256)" in capsys.readouterr().err
