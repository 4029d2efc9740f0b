"""Every manifest in deploy/kubernetes against the Kubernetes API schemas, offline: kubernetes-validate ships the
JSON schemas of each Kubernetes release (strict variants: unknown fields are errors, as with kubectl's server-side
field validation). KEDA's ScaledObject is a custom resource, so it is checked with jsonschema against
keda_scaledobject.schema.json (written from KEDA's documented fields), and the HPA behavior it carries against
Kubernetes' own autoscaling/v2 schema. The kustomization must list every manifest, and renders with kubectl's
built-in kustomize when kubectl is installed."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, latest_version

from tests.deploy.manifests import (
    EXAMPLE_SECRET,
    K8S_DIR,
    KUSTOMIZATION,
    Obj,
    load_documents,
    manifest_files,
    objects,
    of_kind,
)

# The oldest Kubernetes release these manifests must work on, and the newest one whose schemas are installed.
K8S_VERSIONS = ("1.30", ".".join(latest_version().split(".")[:2]))
CUSTOM_KINDS = {"ScaledObject"}  # validated below with our own schema
KEDA_SCHEMA = json.loads((Path(__file__).parent / "keda_scaledobject.schema.json").read_text())


def core_objects() -> list[Obj]:
    return [o for o in objects() if o.kind not in CUSTOM_KINDS]


def validate_kubernetes(doc: dict, version: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = "/".join(str(p) for p in e.path)
        raise AssertionError(f"Kubernetes {version} schema: at {path or '(top)'}: {e.message}") from None


def keda_errors(doc: dict) -> list[str]:
    validator = jsonschema.Draft202012Validator(KEDA_SCHEMA)
    return [
        f"{'/'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    ]


@pytest.mark.parametrize("path", manifest_files() + [K8S_DIR / KUSTOMIZATION], ids=lambda p: p.name)
def test_every_file_is_yaml_of_named_objects(path: Path):
    docs = load_documents(path)  # also refuses duplicate keys
    assert docs, f"{path.name} holds no document"
    for doc in docs:
        assert isinstance(doc, dict) and {"apiVersion", "kind"} <= set(doc), f"{path.name}: not an object: {doc}"
        if doc["kind"] != "Kustomization":
            assert doc.get("metadata", {}).get("name"), f"{path.name}: {doc['kind']} without metadata.name"


def test_names_are_unique_per_kind():
    seen = {}
    for o in objects():
        assert (o.kind, o.name) not in seen, f"{o} and {seen[(o.kind, o.name)]} share a name"
        seen[(o.kind, o.name)] = o


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("obj", core_objects(), ids=str)
def test_kubernetes_schema(obj: Obj, version: str):
    try:
        validate_kubernetes(obj.doc, version)
    except SchemaNotFoundError as e:
        pytest.fail(f"{obj}: {e.message}: a custom resource needs its own schema here (see CUSTOM_KINDS)")


def test_the_kubernetes_schemas_are_strict():
    """The validator itself: an unknown field and a wrong type are errors (so the tests above can fail)."""
    deployment = copy.deepcopy(of_kind("Deployment")[0].doc)
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 30  # typo
    with pytest.raises(AssertionError, match="terminationGracePeriodSecond"):
        validate_kubernetes(deployment, K8S_VERSIONS[-1])
    deployment = copy.deepcopy(of_kind("Deployment")[0].doc)
    deployment["spec"]["template"]["spec"]["containers"][0]["args"] = "gateway --config x"  # not a list
    with pytest.raises(AssertionError, match="not of type"):
        validate_kubernetes(deployment, K8S_VERSIONS[0])


@pytest.mark.parametrize("obj", of_kind("ScaledObject"), ids=str)
def test_keda_scaledobject_schema(obj: Obj):
    assert keda_errors(obj.doc) == []


@pytest.mark.parametrize("obj", of_kind("ScaledObject"), ids=str)
def test_keda_hpa_behavior_is_a_valid_hpa_behavior(obj: Obj):
    """KEDA copies advanced.horizontalPodAutoscalerConfig.behavior into the HPA it creates: check it as one."""
    spec = obj.doc["spec"]
    behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
    if behavior is None:
        pytest.skip("no HPA behavior")
    target = spec["scaleTargetRef"]
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "keda-hpa"},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": target.get("apiVersion", "apps/v1"),
                "kind": target.get("kind", "Deployment"),
                "name": target["name"],
            },
            "minReplicas": max(1, spec.get("minReplicaCount", 0)),
            "maxReplicas": spec.get("maxReplicaCount", 100),
            "behavior": behavior,
        },
    }
    for version in K8S_VERSIONS:
        validate_kubernetes(hpa, version)


@pytest.mark.parametrize(
    "mistake, expected",
    [
        (lambda s: s["triggers"][0]["metadata"].update(threshold=1), "is not of type 'string'"),
        (lambda s: s["triggers"][0]["metadata"].update(treshold="1"), "'treshold' was unexpected"),
        (lambda s: s["triggers"][0]["metadata"].pop("query"), "'query' is a required property"),
        (lambda s: s["scaleTargetRef"].pop("name"), "'name' is a required property"),
        (lambda s: s.update(minReplicas=1), "'minReplicas' was unexpected"),
        (lambda s: s.update(fallback={"replicas": 2}), "'failureThreshold' is a required property"),
        (lambda s: s.update(triggers=[]), "should be non-empty"),
    ],
)
def test_the_keda_schema_catches_mistakes(mistake, expected):
    doc = copy.deepcopy(of_kind("ScaledObject")[0].doc)
    mistake(doc["spec"])
    errors = keda_errors(doc)
    assert any(expected in e for e in errors), errors


def test_kustomization_lists_every_manifest():
    kustomization = load_documents(K8S_DIR / KUSTOMIZATION)[0]
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization.get("resources") or []
    assert len(listed) == len(set(listed)), f"listed twice: {listed}"
    for name in listed:
        assert (K8S_DIR / name).is_file(), f"kustomization.yaml lists {name}, which does not exist"
    expected = {p.name for p in manifest_files()} - {EXAMPLE_SECRET}
    assert set(listed) == expected, (
        f"not listed: {sorted(expected - set(listed))}; listed but no manifest: {sorted(set(listed) - expected)}"
    )
    assert EXAMPLE_SECRET not in listed, "the example Secret (placeholder credentials) must not be applied"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) not installed")
def test_kustomize_renders_every_object_in_the_namespace():
    out = subprocess.run(["kubectl", "kustomize", str(K8S_DIR)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    namespace = load_documents(K8S_DIR / KUSTOMIZATION)[0]["namespace"]
    expected = {(o.kind, o.name) for o in objects() if o.file != EXAMPLE_SECRET}
    assert {(d["kind"], d["metadata"]["name"]) for d in rendered} == expected
    for doc in rendered:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == namespace, doc["metadata"]
