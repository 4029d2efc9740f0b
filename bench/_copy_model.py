"""Demo checkpoints that copy from their context, for the speculative decoding benchmark.

Random weights never copy a prompt, so neither n-gram lookup nor a draft model could be right about them on an
extraction workload. This trains a demo checkpoint (model/demo.py: its byte-level BPE tokenizer and random Llama
weights) for a few minutes on CPU, with transformers, on one task built from the same local text the tokenizer was
trained on (the pydoc topics that ship with Python): a passage of 40 tokens, then the same passage again. The
tiny size learns it in about 1000 steps on one core (~2 minutes here): ~99% of the repeated tokens right. What it
learns that fast is to copy from 40 positions back, not to copy in general: with passages of 32-80 tokens it
reached ~51% after 1000 steps, and a 40-token model copies ~9% of such passages. The benchmark's prompts are
therefore 40-token passages; two checkpoints trained this way (a target and a draft) agree on most tokens.

Trained checkpoints are cached in the given folder under the task, their size, seed and training steps.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

BOS = 0  # the demo tokenizer's <|begin_of_text|>
TASK = "repeat40"  # names the training task in the cache: a changed task must not reuse checkpoints of another
PASSAGE_TOKENS = 40


def corpus_ids(tokenizer_json: Path) -> list[int]:
    from tokenizers import Tokenizer

    from tokenfleet.model.demo import training_corpus

    tok = Tokenizer.from_file(str(tokenizer_json))
    ids: list[int] = []
    for doc in training_corpus():
        ids.extend(tok.encode(doc, add_special_tokens=False).ids)
    return ids


def quote_example(ids: list[int], rng: random.Random) -> list[int]:
    """BOS, a passage of the corpus, then the passage again."""
    n = PASSAGE_TOKENS
    start = rng.randrange(len(ids) - n)
    passage = ids[start : start + n]
    return [BOS, *passage, *passage]


def trained_checkpoint(folder: Path, size: str, seed: int, steps: int, threads: int) -> Path:
    """The demo checkpoint of this size and seed, trained to copy for `steps` steps of 16 examples (cached)."""
    path = folder / f"{TASK}-{size}-seed{seed}-{steps}steps"
    if (path / "trained.json").is_file():
        return path
    import torch
    import transformers

    from tokenfleet.model.demo import write_demo_checkpoint

    torch.set_num_threads(threads)
    write_demo_checkpoint(path, size=size, seed=seed)
    ids = corpus_ids(path / "tokenizer.json")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    rng = random.Random(seed)
    started, loss = time.monotonic(), float("nan")
    for _ in range(steps):
        loss = _train_step(model, optimizer, [quote_example(ids, rng) for _ in range(16)])
    model.save_pretrained(path, safe_serialization=True)
    seconds = round(time.monotonic() - started)
    summary = {"size": size, "seed": seed, "steps": steps, "seconds": seconds, "final_loss": round(loss, 3)}
    (path / "trained.json").write_text(json.dumps(summary) + "\n")
    return path


def _train_step(model, optimizer, examples: list[list[int]]) -> float:
    import torch

    width = max(len(e) for e in examples)
    x = torch.full((len(examples), width), BOS, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, example in enumerate(examples):
        x[i, : len(example)] = torch.tensor(example)
        labels[i, : len(example)] = x[i, : len(example)]
    loss = model(input_ids=x, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.item())
