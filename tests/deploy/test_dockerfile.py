"""deploy/Dockerfile, read (no container engine here): it installs the torch version pyproject.toml pins, on a Python
that pyproject.toml accepts, copies only paths that exist and that .dockerignore lets through, runs as the user the
manifests expect, and its entry point is the tokenfleet command."""

from __future__ import annotations

import json
import re
import tomllib

import pytest
from packaging.specifiers import SpecifierSet

from tests.deploy.manifests import DOCKERFILE, ROOT, of_kind, pod_spec

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def args_defaults() -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in instructions() if word == "ARG" and "=" in rest)


def expand(text: str) -> str:
    defaults = args_defaults()
    return re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), m.group(0)), text)


def test_base_image_python_satisfies_requires_python():
    bases = [rest for word, rest in instructions() if word == "FROM"]
    assert len(bases) == 1, "one stage"
    version = re.match(r"python:(\d+\.\d+)", bases[0])
    assert version, f"expected an official python image, got {bases[0]}"
    assert version.group(1) in SpecifierSet(PYPROJECT["project"]["requires-python"])


def test_torch_is_the_pinned_version():
    pin = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    installs = [expand(rest) for word, rest in instructions() if word == "RUN" and "torch==" in expand(rest)]
    assert installs, "the Dockerfile installs no pinned torch"
    assert all(pin.replace(" ", "") in i.replace('"', "") for i in installs), f"{installs} vs {pin}"
    torch_run = installs[0]
    assert "--index-url" in torch_run, "the CPU / GPU choice is the index URL (TORCH_INDEX_URL)"
    assert args_defaults()["TORCH_INDEX_URL"].endswith("/cpu"), "CPU by default"


def test_copied_paths_exist_and_are_not_ignored():
    ignore = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for word, rest in instructions():
        if word != "COPY" or rest.startswith("--from"):
            continue
        *sources, _ = rest.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
            if "*" in ignore:
                assert source.rstrip("/") in allowed, f"COPY {source}: .dockerignore leaves it out of the context"
    assert "pyproject.toml" in allowed and "tokenfleet" in allowed


def test_runs_as_the_manifests_user_with_tokenfleet_as_entry_point():
    users = [rest for word, rest in instructions() if word == "USER"]
    assert users, "the image must not run as root"
    uid, _, gid = users[-1].partition(":")
    for deployment in of_kind("Deployment"):
        context = pod_spec(deployment).get("securityContext") or {}
        assert str(context.get("runAsUser")) == uid, f"{deployment.name} runs as {context.get('runAsUser')}"
        if gid and "runAsGroup" in context:
            assert str(context["runAsGroup"]) == gid
    entry = [rest for word, rest in instructions() if word == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["tokenfleet"]


@pytest.mark.parametrize("port", [8000, 8100])
def test_exposes_the_default_ports(port):
    exposed = " ".join(rest for word, rest in instructions() if word == "EXPOSE").split()
    assert str(port) in exposed
