#!/usr/bin/env python3
"""The evaluation gate (`tokenfleet eval`) on every quantized format the loader reads, for the demo checkpoints.

Run by hand, never from the test suite:

    python bench/eval_gate.py --out docs/benchmarks/eval_gate.md

Checkpoints: the small demo checkpoint (`tokenfleet demo-model --size small`, random weights) and, unless
--trained-steps is 0, the tiny-h32 demo checkpoint that bench/speculative.py trains to quote its context
(bench/_copy_model.py, cached in --models-dir). Each is written, in a temp folder, in every format of
tests/quantized_checkpoints.py (its writers, imported) plus compressed-tensors FP8 per channel, and evaluated with
`tokenfleet eval --model VARIANT --reference FULL`, where FULL is the unquantized checkpoint itself: what the gate
measures is the quantization's error, not the loader's (the tests compare each format with its dequantized copy).
The on-line formats are `--model FULL --quantization fp8|int8`. Two texts: the gate's built-in corpus (English
prose, not in the demo tokenizer's training text) and a "copy" text of pydoc passages each repeated three times,
the task the trained checkpoint learnt, where its next-token distributions are peaked.

The gate's thresholds are --max-kl, --min-agreement and --max-ppl-ratio (perplexity at most that times the
reference's, passed to eval as --max-perplexity); the report's verdict is eval's own exit status.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import command_line, cpu_model, git_head, report_header  # noqa: E402

COPY_PASSAGE_TOKENS = 40  # the trained checkpoint copies from 40 positions back (bench/_copy_model.py)
COPY_REPEATS = 3
COPY_PASSAGES = 12
# compressed-tensors FP8 with one scale per output channel, as llm-compressor's FP8 (non-dynamic) scheme writes it;
# tests/quantized_checkpoints.py's FORMATS has only its per-tensor variant.
EXTRA_FORMATS = {"ct-float-channel": ("float-quantized", "float8_e4m3fn", True)}
FORMAT_NAMES = {
    "fp8-tensor": "fp8 quantization_config, per-tensor FP8",
    "fp8-channel": "fp8 quantization_config, per-channel FP8",
    "ct-float-tensor": "compressed-tensors FP8, per-tensor",
    "ct-float-channel": "compressed-tensors FP8, per-channel",
    "ct-int-channel": "compressed-tensors INT8 W8A16 (int-quantized)",
    "ct-pack-channel": "compressed-tensors INT8 W8A16 (pack-quantized)",
    "online-fp8": "on-line `--quantization fp8`",
    "online-int8": "on-line `--quantization int8`",
}


@dataclass(frozen=True)
class GateRow:
    checkpoint: str
    text: str
    variant: str
    tokens: int
    perplexity: float
    reference_perplexity: float
    mean_kl: float
    top1_agreement: float
    passed: bool
    failures: list[str]
    seconds: float


def run_eval(model: Path, reference: Path | None, text: Path | None, extra: list[str]) -> tuple[int, str]:
    command = [sys.executable, "-m", "tokenfleet", "eval", "--model", str(model), *extra]
    if reference is not None:
        command += ["--reference", str(reference)]
    if text is not None:
        command += ["--text", str(text)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")
    return done.returncode, done.stdout


def parse_report(stdout: str) -> dict[str, float]:
    """eval's report lines ("perplexity:           4324.9145", ...) by their label."""
    labels = {
        "tokens scored": "tokens",
        "perplexity": "perplexity",
        "reference perplexity": "reference_perplexity",
        "mean KL(ref || model)": "mean_kl",
        "top-1 agreement": "top1_agreement",
    }
    values = {}
    for line in stdout.splitlines():
        label, _, value = line.partition(":")
        if label.strip() in labels and value.strip():
            values[labels[label.strip()]] = float(value.split()[0])
    return values


def gate_row(
    checkpoint: str, text_name: str, variant: str, run: tuple[Path, list[str]], full: Path, text: Path, gate: list[str]
) -> GateRow:
    model, extra = run
    started = time.monotonic()
    status, stdout = run_eval(model, full, text, extra + gate)
    values = parse_report(stdout)
    failures = [line.removeprefix("FAIL: ") for line in stdout.splitlines() if line.startswith("FAIL: ")]
    return GateRow(
        checkpoint,
        text_name,
        variant,
        int(values["tokens"]),
        values["perplexity"],
        values["reference_perplexity"],
        values["mean_kl"],
        values["top1_agreement"],
        status == 0,
        failures,
        round(time.monotonic() - started, 1),
    )


def variants(full: Path, folder: Path) -> dict[str, tuple[Path, list[str]]]:
    """variant name -> (checkpoint folder, extra eval flags): the reference itself, each written format, on-line."""
    import torch

    from tests import quantized_checkpoints

    for name, (kind, dtype, per_channel) in EXTRA_FORMATS.items():
        quantized_checkpoints.FORMATS.setdefault(name, (kind, getattr(torch, dtype), per_channel))
    runs: dict[str, tuple[Path, list[str]]] = {"unquantized (itself)": (full, [])}
    for fmt in FORMAT_NAMES:
        if fmt.startswith("online-"):
            runs[fmt] = (full, ["--quantization", fmt.removeprefix("online-")])
        else:
            quantized, _ = quantized_checkpoints.write_quantized(full, folder / fmt, fmt)
            runs[fmt] = (quantized, [])
    return runs


def copy_text(tokenizer_json: Path, path: Path) -> Path:
    """COPY_PASSAGES pydoc passages of COPY_PASSAGE_TOKENS tokens, each repeated COPY_REPEATS times, one a line."""
    from tokenizers import Tokenizer

    from bench._copy_model import corpus_ids

    tok = Tokenizer.from_file(str(tokenizer_json))
    ids, rng = corpus_ids(tokenizer_json), random.Random(0)
    lines: list[str] = []
    while len(lines) < COPY_PASSAGES:
        start = rng.randrange(len(ids) - COPY_PASSAGE_TOKENS)
        passage = tok.decode(ids[start : start + COPY_PASSAGE_TOKENS])
        if "\n" not in passage and passage.startswith(" "):  # a clean word boundary where the repeats join
            lines.append(passage * COPY_REPEATS)
    path.write_text("\n".join(lines) + "\n")
    return path


def checkpoints(args: argparse.Namespace, folder: Path) -> dict[str, Path]:
    small = folder / "small"
    subprocess.run(
        [sys.executable, "-m", "tokenfleet", "demo-model", "--size", "small", str(small)],
        check=True,
        capture_output=True,
    )
    found = {"small (random weights)": small}
    if args.trained_steps > 0:
        from bench._copy_model import trained_checkpoint
        from bench.speculative import register_sizes

        register_sizes()
        trained = trained_checkpoint(Path(args.models_dir), "tiny-h32", 0, args.trained_steps, 1)
        found[f"tiny-h32 (trained, {args.trained_steps} steps)"] = trained
    return found


def gate_flags(args: argparse.Namespace, reference_perplexity: float) -> list[str]:
    return [
        "--max-kl",
        str(args.max_kl),
        "--min-agreement",
        str(args.min_agreement),
        "--max-perplexity",
        f"{reference_perplexity * args.max_ppl_ratio:.4f}",
    ]


def measure(args: argparse.Namespace, folder: Path) -> list[GateRow]:
    rows = []
    for checkpoint, full in checkpoints(args, folder).items():
        texts = {
            "built-in corpus": folder / "corpus.txt",
            "copy text": copy_text(full / "tokenizer.json", folder / f"copy-{full.name}.txt"),
        }
        from tokenfleet.commands.eval import CORPUS

        texts["built-in corpus"].write_text(CORPUS)
        runs = variants(full, folder / f"variants-{full.name}")
        for text_name, text in texts.items():
            reference_ppl = parse_report(run_eval(full, None, text, [])[1])["perplexity"]
            for variant, run in runs.items():
                row = gate_row(checkpoint, text_name, variant, run, full, text, gate_flags(args, reference_ppl))
                print(
                    f"{checkpoint} | {text_name} | {variant}: KL {row.mean_kl:.2e} agree {row.top1_agreement:.4f} "
                    f"ppl {row.perplexity:.3f}/{row.reference_perplexity:.3f} {'PASS' if row.passed else 'FAIL'}",
                    flush=True,
                )
                rows.append(row)
    return rows


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()


def table(rows: list[GateRow]) -> list[str]:
    lines = [
        "| checkpoint | text | format | top-1 agreement | mean KL (nats) | perplexity | reference perplexity | "
        "ratio | gate |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        verdict = "PASS" if r.passed else "FAIL: " + "; ".join(r.failures)
        lines.append(
            f"| {r.checkpoint} | {r.text} | {FORMAT_NAMES.get(r.variant, r.variant)} | {r.top1_agreement:.4f} | "
            f"{r.mean_kl:.2e} | {r.perplexity:.3f} | {r.reference_perplexity:.3f} | "
            f"{r.perplexity / r.reference_perplexity:.4f} | {verdict} |"
        )
    return lines


def render(args: argparse.Namespace, rows: list[GateRow], load: dict[str, str], seconds: float) -> str:
    tokens = {(r.checkpoint, r.text): r.tokens for r in rows}
    scored = "; ".join(f"{c}, {t}: {n}" for (c, t), n in tokens.items())
    return "\n".join(
        [
            *report_header(__file__, f"{cpu_model()}; commit {git_head()}; {seconds:.0f} s in all.", load),
            f"Gate: `--max-kl {args.max_kl} --min-agreement {args.min_agreement} --max-perplexity "
            f"<reference perplexity x {args.max_ppl_ratio}>`, against the unquantized checkpoint.",
            "",
            *table(rows),
            "",
            f"Positions scored: {scored}.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trained-steps", type=int, default=1000, help="the trained checkpoint's steps; 0 skips it")
    parser.add_argument("--models-dir", default="/tmp/tokenfleet-bench-copy-models", help="bench/speculative.py's")
    parser.add_argument("--max-kl", type=float, default=0.01, help="gate: mean KL divergence at most (nats)")
    parser.add_argument("--min-agreement", type=float, default=0.95, help="gate: top-1 agreement at least")
    parser.add_argument("--max-ppl-ratio", type=float, default=1.01, help="gate: perplexity / reference at most")
    parser.add_argument("--out", default=None, help="write the markdown table here (and its .json beside it)")
    args = parser.parse_args()
    load, started = {"before": uptime()}, time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tokenfleet-eval-gate-") as folder:
        rows = measure(args, Path(folder))
    load["after"] = uptime()
    report = render(args, rows, load, time.monotonic() - started)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
        data = {"command": command_line(__file__), "args": vars(args), "load": load, "rows": [asdict(r) for r in rows]}
        Path(args.out).with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
