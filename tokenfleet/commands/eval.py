"""`tokenfleet eval`: the evaluation gate for a quantized (or otherwise changed) build. Over a fixed corpus it
measures the model's perplexity and, against a reference model, the mean KL divergence of the next-token
distributions and how often both pick the same top-1 token; past a threshold it exits non-zero, so a deploy
pipeline can gate on it.

The corpus is the checkpoint's tokenizer applied to CORPUS (or --text FILE); a checkpoint without a tokenizer is
read on token ids drawn from a fixed seed, which still compares two models' distributions position by position.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenfleet.model.attention import AttentionMetadata, PrefillChunk
from tokenfleet.model.llama import LlamaForCausalLM
from tokenfleet.model.loader import load_model

CORPUS = """\
The river rose slowly through the night, and by morning the lower fields were under a sheet of brown water.
Farmers moved their animals to the ridge road, where the old stone wall kept the current away from the barns.
A computer program is a sequence of instructions that a machine follows to transform its input into output.
Good programs are written for people first: names that explain themselves, small functions, and tests that fail.
In 1869 the first transcontinental railroad in the United States was completed at Promontory Summit, Utah.
The recipe calls for two cups of flour, one egg, a pinch of salt and enough milk to make a smooth batter.
Light travels about three hundred thousand kilometres per second, so sunlight takes eight minutes to reach us.
She opened the letter, read the first line twice, and then sat down by the window to read the rest.
"""
SEQUENCE_LEN = 128
NUM_SEQUENCES = 8
SCRATCH_BLOCK = 16
EXIT_FAILED = 1


@dataclass(frozen=True)
class EvalResult:
    tokens: int  # positions scored (each predicts the next token)
    perplexity: float
    reference_perplexity: float | None = None
    mean_kl: float | None = None  # KL(reference || model) per position, in nats
    top1_agreement: float | None = None


def add_eval(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint folder under evaluation")
    parser.add_argument(
        "--reference", "--baseline", default=None, help="checkpoint folder to compare with (e.g. the unquantized)"
    )
    parser.add_argument("--quantization", choices=("fp8", "int8"), default=None, help="quantize --model at load")
    parser.add_argument("--text", default=None, help="text file to evaluate on (default: the built-in corpus)")
    parser.add_argument("--max-kl", type=float, default=None, help="fail when the mean KL divergence is above")
    parser.add_argument("--min-agreement", type=float, default=None, help="fail when top-1 agreement is below")
    parser.add_argument("--max-perplexity", type=float, default=None, help="fail when the perplexity is above")


def run_eval(args: argparse.Namespace) -> int:
    if (args.max_kl is not None or args.min_agreement is not None) and args.reference is None:
        print("tokenfleet eval: --max-kl and --min-agreement need --reference", file=sys.stderr)
        return 2
    model = load_model(args.model, quantization=args.quantization)
    reference = load_model(args.reference) if args.reference else None
    text = Path(args.text).read_text() if args.text else CORPUS
    sequences = corpus_sequences(Path(args.model), model.config.vocab_size, text)
    result = evaluate(model, reference, sequences, progress=_print_progress)
    print(report(result))
    failures = gate_failures(result, args.max_kl, args.min_agreement, args.max_perplexity)
    for failure in failures:
        print(f"FAIL: {failure}")
    print("FAIL" if failures else "PASS")
    return EXIT_FAILED if failures else 0


def corpus_sequences(model_dir: Path, vocab_size: int, text: str) -> list[list[int]]:
    if (model_dir / "tokenizer.json").is_file():
        from tokenfleet.model.tokenizer import Tokenizer

        ids = Tokenizer.from_dir(model_dir).encode(text, add_special_tokens=False)
        return [ids[i : i + SEQUENCE_LEN] for i in range(0, len(ids), SEQUENCE_LEN) if len(ids[i:]) > 1]
    generator = torch.Generator().manual_seed(0)
    drawn: list[list[int]] = torch.randint(0, vocab_size, (NUM_SEQUENCES, SEQUENCE_LEN), generator=generator).tolist()
    return drawn


def sequence_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """float32 logits [len(ids), vocab] at every position: one prefill of the sequence over a scratch KV cache."""
    config, weight = model.config, model.embed_tokens.weight
    positions = torch.arange(len(ids), device=weight.device)
    blocks = math.ceil(len(ids) / SCRATCH_BLOCK)
    cache_shape = (config.num_layers, 2, config.num_kv_heads, blocks, SCRATCH_BLOCK * config.head_dim)
    caches = torch.zeros(cache_shape, dtype=weight.dtype, device=weight.device)
    meta = AttentionMetadata(
        slot_blocks=positions // SCRATCH_BLOCK,
        slot_offsets=positions % SCRATCH_BLOCK,
        block_size=SCRATCH_BLOCK,
        decodes=[],
        prefills=[PrefillChunk(query_start=0, query_len=len(ids), context=None, mask=None)],
    )
    logits: torch.Tensor = model(torch.tensor(ids, device=weight.device), positions, caches, meta, positions)
    return logits.float()


def evaluate(
    model: LlamaForCausalLM,
    reference: LlamaForCausalLM | None,
    sequences: list[list[int]],
    progress: Callable[[int, int, int, float], None] | None = None,
) -> EvalResult:
    if reference is not None and reference.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"the reference's vocabulary ({reference.config.vocab_size}) is not the model's "
            f"({model.config.vocab_size}): their distributions cannot be compared"
        )
    nll = ref_nll = kl = agree = 0.0
    tokens, started = 0, time.monotonic()
    for index, ids in enumerate(sequences):
        targets = torch.tensor(ids[1:])
        logp = F.log_softmax(sequence_logits(model, ids)[:-1], dim=-1)
        nll += -logp.gather(1, targets[:, None]).sum().item()
        if reference is not None:
            ref_logp = F.log_softmax(sequence_logits(reference, ids)[:-1], dim=-1)
            ref_nll += -ref_logp.gather(1, targets[:, None]).sum().item()
            kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
            agree += (ref_logp.argmax(-1) == logp.argmax(-1)).sum().item()
        tokens += len(targets)
        if progress:
            progress(index + 1, len(sequences), tokens, time.monotonic() - started)
    if tokens == 0:
        raise ValueError("the evaluation corpus has no tokens to score")
    if reference is None:
        return EvalResult(tokens, math.exp(nll / tokens))
    return EvalResult(tokens, math.exp(nll / tokens), math.exp(ref_nll / tokens), kl / tokens, agree / tokens)


def gate_failures(
    result: EvalResult, max_kl: float | None, min_agreement: float | None, max_perplexity: float | None
) -> list[str]:
    failures = []
    if max_kl is not None and result.mean_kl is not None and result.mean_kl > max_kl:
        failures.append(f"mean KL divergence {result.mean_kl:.6f} > --max-kl {max_kl}")
    if min_agreement is not None and result.top1_agreement is not None and result.top1_agreement < min_agreement:
        failures.append(f"top-1 agreement {result.top1_agreement:.4f} < --min-agreement {min_agreement}")
    if max_perplexity is not None and result.perplexity > max_perplexity:
        failures.append(f"perplexity {result.perplexity:.3f} > --max-perplexity {max_perplexity}")
    return failures


def report(result: EvalResult) -> str:
    lines = [f"tokens scored:        {result.tokens}", f"perplexity:           {result.perplexity:.4f}"]
    if result.mean_kl is not None:
        lines += [
            f"reference perplexity: {result.reference_perplexity:.4f}",
            f"mean KL(ref || model): {result.mean_kl:.6f} nats",
            f"top-1 agreement:      {result.top1_agreement:.4f}",
        ]
    return "\n".join(lines)


def _print_progress(done: int, total: int, tokens: int, seconds: float) -> None:
    print(f"eval: {done}/{total} sequences, {tokens} tokens, {seconds:.1f} s", file=sys.stderr, flush=True)
