"""A fleet's gateway (and the simulator, keys and usage commands) never loads PyTorch: it holds no model, and
importing PyTorch would cost each gateway process seconds of start-up and a couple of hundred MB."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
sys.modules["torch"] = None  # any import of torch now raises ImportError, naming the importer in its traceback
import tokenfleet.commands.serve, tokenfleet.sim.command, tokenfleet.sim.fleet
from tokenfleet.cli import build_parser
for words in (["gateway", "--config", "fleet.yaml"], ["simulate", "--config", "sim.yaml"], ["keys", "list"],
              ["usage"]):
    build_parser(only=words[0]).parse_args(words)
from tokenfleet.model.config import ModelConfig
ModelConfig.from_dir(sys.argv[1]).max_model_len
print("ok")
"""


def test_the_gateway_and_the_simulator_import_no_torch(demo_model_dir):
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(demo_model_dir)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
