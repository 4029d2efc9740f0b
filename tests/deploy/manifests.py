"""Reading deploy/kubernetes for the tests: every YAML document of every file (duplicate keys are an error, as
they are for kubectl), lookups by kind and name, and the pieces the invariants look at (containers, the
tokenfleet command line, env, preStop, the fleet.yaml in the ConfigMap)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
KUSTOMIZATION = "kustomization.yaml"
EXAMPLE_SECRET = "secret.example.yaml"  # validated, but not applied by kustomize: real secrets are made by hand


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with the same key twice (PyYAML would silently keep the last one)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.load_all(path.read_text(), Loader=UniqueKeyLoader) if doc is not None]


def manifest_files() -> list[Path]:
    """Every manifest (not the kustomization itself)."""
    return sorted(p for p in K8S_DIR.glob("*.yaml") if p.name != KUSTOMIZATION)


@dataclass(frozen=True)
class Obj:
    file: str
    index: int  # position of the document in its file
    doc: dict

    @property
    def kind(self) -> str:
        return self.doc["kind"]

    @property
    def name(self) -> str:
        return self.doc["metadata"]["name"]

    def __str__(self) -> str:
        return f"{self.file}#{self.index} {self.kind}/{self.name}"


def objects() -> list[Obj]:
    """Every document of every manifest. A file that is not valid YAML is left out here (the tests are collected
    from this list) and fails test_every_file_is_yaml_of_named_objects instead."""
    out = []
    for path in manifest_files():
        try:
            docs = load_documents(path)
        except yaml.YAMLError:
            continue
        out += [Obj(path.name, i, doc) for i, doc in enumerate(docs) if isinstance(doc, dict) and "kind" in doc]
    return out


def of_kind(kind: str) -> list[Obj]:
    return [o for o in objects() if o.kind == kind]


def find(kind: str, name: str) -> Obj | None:
    return next((o for o in of_kind(kind) if o.name == name), None)


def pod_spec(deployment: Obj) -> dict:
    return deployment.doc["spec"]["template"]["spec"]


def containers(deployment: Obj) -> list[dict]:
    return pod_spec(deployment)["containers"]


def role(container: dict) -> str | None:
    """The tokenfleet subcommand a container runs (gateway, replica, ...), or None for anything else."""
    command = list(container.get("command") or []) + list(container.get("args") or [])
    return command[1] if len(command) > 1 and command[0] == "tokenfleet" else None


def deployments_of(role_name: str) -> list[tuple[Obj, dict]]:
    """(Deployment, container) for every container running `tokenfleet <role_name>`."""
    return [(d, c) for d in of_kind("Deployment") for c in containers(d) if role(c) == role_name]


# --- the command line -------------------------------------------------------------------------------------------

VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args, with made-up values for the variables."""
    return VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), arg)


def sample_env(container: dict) -> dict[str, str]:
    """The container's environment as the kubelet would fill it, with stand-in values for fieldRefs."""
    stand_ins = {"status.podIP": "10.1.2.3", "metadata.name": "pod-0", "metadata.namespace": "tokenfleet"}
    env = {}
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
        elif "fieldRef" in (var.get("valueFrom") or {}):
            env[var["name"]] = stand_ins.get(var["valueFrom"]["fieldRef"]["fieldPath"], "x")
        else:
            env[var["name"]] = "from-a-secret"
    return env


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    from tokenfleet.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


class BadArguments(Exception):
    pass


def parse_tokenfleet(container: dict) -> argparse.Namespace:
    """The container's `tokenfleet SUBCOMMAND ...` parsed by the real CLI parser. Every --flag must be spelled out
    in full: argparse would also take an unambiguous prefix (--drain for --drain-timeout), which is fragile."""
    words = [
        expand(str(w), sample_env(container))
        for w in list(container.get("command") or []) + list(container.get("args") or [])
    ]
    if not words or words[0] != "tokenfleet":
        raise BadArguments(f"not a tokenfleet command: {words}")
    sub = subcommand_parser(words[1])
    known = set(sub._option_string_actions)
    for word in words[2:]:
        if word.startswith("--") and word.split("=", 1)[0] not in known:
            raise BadArguments(f"tokenfleet {words[1]} has no flag {word.split('=', 1)[0]!r}")
    from tokenfleet.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(words[1:])
    except SystemExit:
        raise BadArguments(err.getvalue().strip()) from None


# --- pieces ------------------------------------------------------------------------------------------------------


def prestop_seconds(container: dict) -> float | None:
    """How long the preStop hook holds SIGTERM back: `sleep N` (exec) or the sleep action. None without a hook."""
    hook = ((container.get("lifecycle") or {}).get("preStop")) or None
    if hook is None:
        return None
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = (hook.get("exec") or {}).get("command") or []
    if len(command) == 2 and command[0] in ("sleep", "/bin/sleep"):
        return float(command[1])
    shell = re.fullmatch(r"sleep (\d+(?:\.\d+)?)", command[2].strip()) if len(command) == 3 else None
    if command[:2] in (["sh", "-c"], ["/bin/sh", "-c"]) and shell:
        return float(shell.group(1))
    raise AssertionError(f"preStop hook of {container['name']} is not a plain sleep: {hook}")


def probe_port(container: dict, probe: dict) -> int:
    """The container port an httpGet probe hits (named ports resolved)."""
    port = probe["httpGet"]["port"]
    if isinstance(port, int):
        return port
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
    if port not in ports:
        raise AssertionError(f"probe port {port!r} is not a named port of {container['name']}")
    return ports[port]


def mounted_configmap_file(deployment: Obj, container: dict, path: str) -> tuple[str, str] | None:
    """(ConfigMap name, key) of the file at `path` inside the container, if a configMap volume provides it."""
    volumes = {v["name"]: v for v in pod_spec(deployment).get("volumes") or []}
    for mount in container.get("volumeMounts") or []:
        root = mount["mountPath"].rstrip("/") + "/"
        volume = volumes.get(mount["name"]) or {}
        if not path.startswith(root) or "configMap" not in volume:
            continue
        relative = path[len(root) :]
        items = volume["configMap"].get("items")
        if items is None:
            return volume["configMap"]["name"], relative
        for item in items:
            if item["path"] == relative:
                return volume["configMap"]["name"], item["key"]
    return None


def pvc_mounts(deployment: Obj, container: dict) -> dict[str, str]:
    """mountPath -> claim name for the container's PersistentVolumeClaim mounts."""
    volumes = {v["name"]: v for v in pod_spec(deployment).get("volumes") or []}
    return {
        m["mountPath"].rstrip("/"): volumes[m["name"]]["persistentVolumeClaim"]["claimName"]
        for m in container.get("volumeMounts") or []
        if "persistentVolumeClaim" in volumes.get(m["name"], {})
    }


def example_secret() -> dict[str, str]:
    secret = load_documents(K8S_DIR / EXAMPLE_SECRET)[0]
    return {**(secret.get("stringData") or {}), **{k: "(base64)" for k in secret.get("data") or {}}}


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
