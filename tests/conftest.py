"""Shared fixtures: a tiny demo checkpoint (byte-level BPE tokenizer + random Llama weights), written once."""
from __future__ import annotations

from pathlib import Path

import pytest

from tokenfleet.model.demo import write_demo_checkpoint


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete HF-format "tiny" Llama checkpoint folder (seed 0). Treat it as read-only; copy it to modify."""
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo-model") / "tiny", size="tiny", seed=0)
