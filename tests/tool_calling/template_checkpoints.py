"""Copies of the demo checkpoint (same weights, same tokenizer) with another chat template, and optionally one of
its special tokens renamed (the vocabulary keeps its size, so the model can still write it): Mistral's
`[TOOL_CALLS]` is a special token in Mistral's vocabularies."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenfleet.model.demo import IM_START


def with_template(demo_dir: Path, dest: Path, template: str, special_token: str | None = None) -> Path:
    """`dest`: the demo checkpoint with `template`; `special_token`, if given, takes the place of <|im_start|>."""
    shutil.copytree(demo_dir, dest)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    if special_token is not None:
        _rename_special(dest / "tokenizer.json", IM_START, special_token)
        for entry in config["added_tokens_decoder"].values():
            if entry["content"] == IM_START:
                entry["content"] = special_token
    config_path.write_text(json.dumps(config, indent=2))
    return dest


def _rename_special(path: Path, old: str, new: str) -> None:
    tokenizer = json.loads(path.read_text())
    for token in tokenizer["added_tokens"]:
        if token["content"] == old:
            token["content"] = new
    vocab = tokenizer["model"]["vocab"]
    vocab[new] = vocab.pop(old)
    path.write_text(json.dumps(tokenizer))
