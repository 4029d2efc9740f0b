"""The layer order of docs/architecture.md, enforced: a package imports only packages in layers below its own (lazy
imports inside functions included), and importing the engine loads nothing of the fleet or the HTTP stack."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tokenfleet"

# Bottom to top. A name is a package (a folder) or a top-level module of tokenfleet.
LAYERS: list[set[str]] = [
    {"table", "logs", "tracing", "settings", "metric_families"},
    {"model"},
    {"engine"},
    {"api"},
    {"quota"},
    {"store", "dispatch", "router"},
    {"metering", "replica", "autoscale", "web"},
    {"gateway"},
    {"conversations", "responses", "billing", "sim"},
    {"config"},
    {"commands"},
    {"cli", "__init__"},
    {"__main__"},
]
LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer}

ENGINE_MAY_NOT_LOAD = (
    "gateway",
    "router",
    "quota",
    "dispatch",
    "store",
    "metering",
    "autoscale",
    "sim",
    "api",
    "replica",
    "conversations",
    "billing",
    "commands",
    "config",
    "web",
)
THIRD_PARTY_NOT_IN_ENGINE = ("fastapi", "starlette", "uvicorn", "httpx", "redis", "sqlalchemy", "prometheus_client")


def _component(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _imported_components(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] if node.level == 0 else []
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "tokenfleet" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_every_component_has_a_layer():
    components = {_component(p) for p in ROOT.rglob("*.py")}
    assert components - set(LAYER_OF) == set(), "add the new package to LAYERS and docs/architecture.md"


def test_packages_import_only_layers_below_their_own():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        own = _component(path)
        for used in _imported_components(path) - {own}:
            if LAYER_OF[used] >= LAYER_OF[own]:
                wrong.append(
                    f"{path.relative_to(ROOT.parent)} ({own}, layer {LAYER_OF[own]}) imports {used} "
                    f"(layer {LAYER_OF[used]})"
                )
    assert wrong == []


def test_importing_the_engine_loads_nothing_above_it():
    script = (
        "import json, sys\n"
        "import tokenfleet.engine.engine, tokenfleet.engine.engine_process, tokenfleet.engine.async_engine\n"
        "import tokenfleet.engine.llm, tokenfleet.engine.config\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    loaded = json.loads(
        subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    )
    ours = {m.split(".")[1] for m in loaded if m.startswith("tokenfleet.")}
    assert ours & set(ENGINE_MAY_NOT_LOAD) == set()
    assert {m.split(".")[0] for m in loaded} & set(THIRD_PARTY_NOT_IN_ENGINE) == set()
