"""Copies of the demo checkpoint (same weights, same tokenizer) with another chat template, and optionally some of
its special tokens renamed (the vocabulary keeps its size, so the model can still write them): Mistral's
`[TOOL_CALLS]` (and from tokenizer v11 `[ARGS]`) are special tokens in Mistral's vocabularies."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenfleet.model.demo import IM_END, IM_START

RENAMABLE = (IM_START, IM_END)  # <|im_end|> stops generation: renamed, it no longer does (EOS still does)


def with_template(demo_dir: Path, dest: Path, template: str, *special_tokens: str) -> Path:
    """`dest`: the demo checkpoint with `template`; `special_tokens`, if given, take the places of <|im_start|>
    and <|im_end|>, in that order."""
    shutil.copytree(demo_dir, dest)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    for old, new in zip(RENAMABLE, special_tokens, strict=False):
        _rename_special(dest / "tokenizer.json", old, new)
        for index, entry in config["added_tokens_decoder"].items():
            if entry["content"] == old:
                entry["content"] = new
                _no_longer_stops(dest / "generation_config.json", int(index))
    config_path.write_text(json.dumps(config, indent=2))
    return dest


def _no_longer_stops(path: Path, token_id: int) -> None:
    config = json.loads(path.read_text())
    stops = config.get("eos_token_id")
    if isinstance(stops, list) and token_id in stops:
        config["eos_token_id"] = [i for i in stops if i != token_id]
        path.write_text(json.dumps(config, indent=2))


def _rename_special(path: Path, old: str, new: str) -> None:
    tokenizer = json.loads(path.read_text())
    for token in tokenizer["added_tokens"]:
        if token["content"] == old:
            token["content"] = new
    vocab = tokenizer["model"]["vocab"]
    vocab[new] = vocab.pop(old)
    path.write_text(json.dumps(tokenizer))
