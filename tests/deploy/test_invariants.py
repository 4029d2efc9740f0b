"""What a reviewer checks across the files of deploy/kubernetes, with tokenfleet's own code where it decides:
the command lines parse with the real CLI parser (tokenfleet.cli.build_parser), the ConfigMap's fleet.yaml loads
with FleetConfig.load (with the Secret's values arriving through the environment), the drain fits in the grace
period, every probe, Secret key, ConfigMap, volume and selector points at something real, the replicas join the
fleet the gateways are configured for, and the ScaledObject scales the replica Deployment on the autoscaler's
decision for exactly that model and pool."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import pytest

from tests.deploy.manifests import (
    EXAMPLE_SECRET,
    BadArguments,
    Obj,
    containers,
    deployments_of,
    example_secret,
    find,
    labels_match,
    mounted_configmap_file,
    objects,
    of_kind,
    parse_tokenfleet,
    pod_spec,
    prestop_seconds,
    probe_port,
    pvc_mounts,
)
from tokenfleet.autoscale.signals import pool_key
from tokenfleet.config import FleetConfig

DRAIN_MARGIN_S = 10  # grace period left after preStop + drain: the process still has to exit
DESIRED_METRIC = "tokenfleet_autoscale_desired_replicas"
IMAGE = "tokenfleet:latest"

GATEWAYS = deployments_of("gateway")
REPLICAS = deployments_of("replica")
ALL = GATEWAYS + REPLICAS


def ids(pairs):
    return [f"{d.name}/{c['name']}" for d, c in pairs]


def fleet_config(deployment: Obj, container: dict, tmp_path, monkeypatch) -> FleetConfig:
    """The gateway's fleet.yaml as the gateway loads it: from the ConfigMap mounted at --config, with the
    container's Secret-backed environment set to the example Secret's values."""
    args = parse_tokenfleet(container)
    source = mounted_configmap_file(deployment, container, args.config)
    assert source is not None, f"--config {args.config} is not a file of a mounted ConfigMap"
    configmap = find("ConfigMap", source[0])
    assert configmap is not None, f"ConfigMap {source[0]} is not among the manifests"
    assert source[1] in configmap.doc.get("data", {}), f"ConfigMap {source[0]} has no key {source[1]}"
    path = tmp_path / "fleet.yaml"
    path.write_text(configmap.doc["data"][source[1]])
    secret = example_secret()
    for var in container.get("env") or []:
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            monkeypatch.setenv(var["name"], secret[ref["key"]])
    return FleetConfig.load(path)


def raw_flag(container: dict, flag: str) -> str:
    """A flag's value as written in the manifest, before $(VAR) expansion."""
    words = [str(w) for w in container.get("args") or []]
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(flag + "="):
            return word[len(flag) + 1 :]
    raise AssertionError(f"{container['name']} has no {flag}")


def gateway_fleet(tmp_path, monkeypatch) -> FleetConfig:
    assert len(GATEWAYS) == 1, "expected one gateway Deployment"
    return fleet_config(*GATEWAYS[0], tmp_path, monkeypatch)


def test_there_is_a_gateway_and_a_replica_pool():
    assert GATEWAYS, "no Deployment runs `tokenfleet gateway`"
    assert REPLICAS, "no Deployment runs `tokenfleet replica`"


# --- command lines ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("deployment, container", ALL, ids=ids(ALL))
def test_args_are_real_tokenfleet_flags(deployment, container):
    try:
        parse_tokenfleet(container)
    except BadArguments as e:
        pytest.fail(f"{deployment.name}: {e}")


@pytest.mark.parametrize("deployment, container", ALL, ids=ids(ALL))
def test_variables_in_args_are_defined(deployment, container):
    defined = {v["name"] for v in container.get("env") or []}
    for word in list(container.get("command") or []) + list(container.get("args") or []):
        for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(word)):
            assert var in defined, f"{word!r} uses $({var}), which the container's env does not define"


@pytest.mark.parametrize("deployment, container", ALL, ids=ids(ALL))
def test_image(deployment, container):
    assert container["image"] == IMAGE


# --- probes and drain -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("deployment, container", ALL, ids=ids(ALL))
def test_probes_hit_health_on_the_served_port(deployment, container, tmp_path, monkeypatch):
    args = parse_tokenfleet(container)
    port = fleet_config(deployment, container, tmp_path, monkeypatch).port if hasattr(args, "config") else args.port
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(kind)
        assert probe is not None, f"{deployment.name}: no {kind}"
        assert probe.get("httpGet", {}).get("path") == "/health", f"{kind} must GET /health"
        assert probe_port(container, probe) == port, (
            f"{kind} probes port {probe_port(container, probe)}, the server listens on {port}"
        )


@pytest.mark.parametrize("deployment, container", ALL, ids=ids(ALL))
def test_grace_period_covers_prestop_and_drain(deployment, container, tmp_path, monkeypatch):
    args = parse_tokenfleet(container)
    drain = (
        fleet_config(deployment, container, tmp_path, monkeypatch).drain_timeout_s
        if hasattr(args, "config")
        else args.drain_timeout
    )
    prestop = prestop_seconds(container)
    assert prestop is not None and prestop > 0, f"{deployment.name}: no preStop hook"
    grace = pod_spec(deployment).get("terminationGracePeriodSeconds", 30)
    assert grace >= prestop + drain + DRAIN_MARGIN_S, (
        f"{deployment.name}: terminationGracePeriodSeconds {grace} < preStop {prestop} + drain {drain} + "
        f"margin {DRAIN_MARGIN_S}: the pod would be killed mid-drain"
    )


@pytest.mark.parametrize("deployment, container", ALL, ids=ids(ALL))
def test_rollouts_keep_capacity(deployment, container):
    rolling = deployment.doc["spec"].get("strategy", {}).get("rollingUpdate", {})
    assert rolling.get("maxUnavailable") == 0, "a rollout must bring a new pod up before draining an old one"


# --- the gateway and its configuration -----------------------------------------------------------------------------


def test_fleet_yaml_loads_and_gets_the_secrets(tmp_path, monkeypatch):
    config = gateway_fleet(tmp_path, monkeypatch)
    secret = example_secret()
    assert config.database_url == secret["database-url"], "TOKENFLEET_DATABASE_URL does not reach the gateway"
    assert config.admin_key == secret["admin-key"], "TOKENFLEET_ADMIN_KEY does not reach the gateway"
    assert config.resume_secret == secret["resume-secret"], "TOKENFLEET_RESUME_SECRET does not reach the gateway"
    assert config.database_url.startswith("postgresql://"), "a fleet keeps its tenants in PostgreSQL"
    assert config.redis_url, "several gateways need Redis (resume buffer, quotas, registry)"
    assert config.served_models(), "the gateway serves no model"
    assert config.host == "0.0.0.0", "the gateway must listen on the pod's address, not loopback"


def test_fleet_yaml_holds_no_secrets():
    import yaml

    raw = yaml.safe_load(find("ConfigMap", "tokenfleet-fleet").doc["data"]["fleet.yaml"])
    for key in ("database_url", "admin_key", "resume_secret"):
        assert raw.get(key) is None, f"{key} belongs in the Secret, not in the ConfigMap"


def test_gateway_service_and_pdb_select_the_gateways_only(tmp_path, monkeypatch):
    ((gateway, container),) = GATEWAYS
    pod_labels = gateway.doc["spec"]["template"]["metadata"]["labels"]
    replica_labels = [d.doc["spec"]["template"]["metadata"]["labels"] for d, _ in REPLICAS]
    port = fleet_config(gateway, container, tmp_path, monkeypatch).port
    services = [s for s in of_kind("Service") if labels_match(s.doc["spec"]["selector"], pod_labels)]
    assert services, "no Service selects the gateway pods"
    for service in services:
        assert not any(labels_match(service.doc["spec"]["selector"], r) for r in replica_labels)
        for p in service.doc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            assert probe_port(container, {"httpGet": {"port": target}}) == port, "Service targets the wrong port"
    pdbs = [
        p for p in of_kind("PodDisruptionBudget") if labels_match(p.doc["spec"]["selector"]["matchLabels"], pod_labels)
    ]
    assert len(pdbs) == 1, "the gateways need exactly one PodDisruptionBudget"
    pdb = pdbs[0].doc["spec"]
    assert not any(labels_match(pdb["selector"]["matchLabels"], r) for r in replica_labels)
    if "minAvailable" in pdb:
        assert isinstance(pdb["minAvailable"], int) and pdb["minAvailable"] < gateway.doc["spec"]["replicas"], (
            "minAvailable >= replicas blocks every node drain"
        )
    else:
        assert pdb.get("maxUnavailable", 0) not in (0, "0%"), "maxUnavailable 0 blocks every node drain"


# --- references between objects --------------------------------------------------------------------------------


@pytest.mark.parametrize("deployment", of_kind("Deployment"), ids=str)
def test_selector_matches_the_pod_template(deployment):
    selector = deployment.doc["spec"]["selector"]["matchLabels"]
    assert labels_match(selector, deployment.doc["spec"]["template"]["metadata"]["labels"])
    for other in of_kind("Deployment"):
        if other.name != deployment.name:
            assert not labels_match(selector, other.doc["spec"]["template"]["metadata"]["labels"]), (
                f"{deployment.name}'s selector also selects {other.name}'s pods"
            )


@pytest.mark.parametrize("deployment", of_kind("Deployment"), ids=str)
def test_referenced_secrets_configmaps_and_claims_exist(deployment):
    secret_name = next(o.name for o in objects() if o.file == EXAMPLE_SECRET)
    secret_keys = example_secret()
    for container in containers(deployment):
        for var in container.get("env") or []:
            ref = (var.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == secret_name, f"{var['name']}: no Secret {ref['name']} (see {EXAMPLE_SECRET})"
                assert ref["key"] in secret_keys, f"{var['name']}: Secret {secret_name} has no key {ref['key']}"
        volume_names = {v["name"] for v in pod_spec(deployment).get("volumes") or []}
        for mount in container.get("volumeMounts") or []:
            assert mount["name"] in volume_names, f"mount of an undeclared volume {mount['name']}"
    for volume in pod_spec(deployment).get("volumes") or []:
        if "configMap" in volume:
            configmap = find("ConfigMap", volume["configMap"]["name"])
            assert configmap is not None, f"no ConfigMap {volume['configMap']['name']}"
            for item in volume["configMap"].get("items") or []:
                assert item["key"] in configmap.doc.get("data", {}), f"ConfigMap has no key {item['key']}"
        if "persistentVolumeClaim" in volume:
            assert find("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) is not None


# --- replicas join the gateways' fleet --------------------------------------------------------------------------


@pytest.mark.parametrize("deployment, container", REPLICAS, ids=ids(REPLICAS))
def test_replica_joins_the_configured_fleet(deployment, container, tmp_path, monkeypatch):
    fleet = gateway_fleet(tmp_path, monkeypatch)
    args = parse_tokenfleet(container)
    models = {m.name: m for m in fleet.served_models()}
    assert args.served_model_name in models, (
        f"--served-model-name {args.served_model_name!r} is not a model of fleet.yaml ({', '.join(models)}): "
        "the gateways would ignore these replicas"
    )
    spec = models[args.served_model_name]
    assert args.pool in {p.name for p in spec.pools}, f"--pool {args.pool} is not a pool of {spec.name}"
    assert args.register == fleet.redis_url, "--register must name the gateways' Redis (redis_url)"
    assert args.registry_prefix == fleet.routing.register_prefix, "registry prefixes differ"
    assert args.block_size == fleet.routing.block_size, "--block-size differs from routing.block_size"
    assert fleet.dispatch.slots_per_replica <= args.max_num_seqs, "gateways would queue work on the replica"
    assert args.host == "0.0.0.0", "the replica must listen on the pod's address"
    advertised = urlsplit(args.advertise_url)
    assert advertised.port == args.port, f"--advertise-url {args.advertise_url} is not --port {args.port}"
    assert "$(POD_IP)" in raw_flag(container, "--advertise-url"), "each replica pod must advertise its own address"
    ports = [p["containerPort"] for p in container.get("ports") or []]
    assert args.port in ports, f"--port {args.port} is not a declared container port {ports}"
    labels = deployment.doc["spec"]["template"]["metadata"]["labels"]
    assert labels.get("tokenfleet.io/model") == args.served_model_name
    assert labels.get("tokenfleet.io/pool") == args.pool


def test_models_are_on_the_models_volume(tmp_path, monkeypatch):
    ((gateway, gateway_container),) = GATEWAYS
    fleet = gateway_fleet(tmp_path, monkeypatch)
    paths = {m.name: m.path for m in fleet.served_models()}

    def claim_of(deployment, container, path):
        mounts = pvc_mounts(deployment, container)
        root = next((r for r in mounts if path.startswith(r + "/")), None)
        assert root is not None, f"{deployment.name}: {path} is on no mounted volume"
        return mounts[root]

    for path in paths.values():
        claim_of(gateway, gateway_container, path)  # the gateway reads tokenizer and config.json there
    for deployment, container in REPLICAS:
        args = parse_tokenfleet(container)
        assert args.model == paths[args.served_model_name], "replica and gateway read different checkpoints"
        assert claim_of(deployment, container, args.model) == claim_of(gateway, gateway_container, args.model)


@pytest.mark.parametrize("deployment, container", REPLICAS, ids=ids(REPLICAS))
def test_replica_gets_a_gpu(deployment, container):
    resources = container.get("resources") or {}
    limit = (resources.get("limits") or {}).get("nvidia.com/gpu")
    assert limit is not None and int(limit) >= 1, "no nvidia.com/gpu limit: the pod would land on any node"
    request = (resources.get("requests") or {}).get("nvidia.com/gpu")
    assert request is None or int(request) == int(limit), "extended resources need requests == limits"
    device = parse_tokenfleet(container).device
    assert device in ("auto", "cuda") or device.startswith("cuda:"), f"--device {device} on a GPU pod"


# --- autoscaling --------------------------------------------------------------------------------------------------


def scaled_objects_for(deployment: Obj) -> list[Obj]:
    return [
        s
        for s in of_kind("ScaledObject")
        if s.doc["spec"]["scaleTargetRef"]["name"] == deployment.name
        and s.doc["spec"]["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
    ]


@pytest.mark.parametrize("scaled", of_kind("ScaledObject"), ids=str)
def test_scaledobject_targets_a_replica_deployment(scaled):
    ref = scaled.doc["spec"]["scaleTargetRef"]
    assert ref.get("apiVersion", "apps/v1") == "apps/v1" and ref.get("kind", "Deployment") == "Deployment"
    target = find("Deployment", ref["name"])
    assert target is not None, f"{scaled}: no Deployment named {ref['name']}"
    assert target.name in {d.name for d, _ in REPLICAS}, f"{scaled} scales {target.name}, not a replica pool"


@pytest.mark.parametrize("deployment, container", REPLICAS, ids=ids(REPLICAS))
def test_every_replica_pool_scales_on_the_autoscaler_decision(deployment, container):
    scaled = scaled_objects_for(deployment)
    assert len(scaled) == 1, f"{deployment.name} needs exactly one ScaledObject, has {len(scaled)}"
    spec = scaled[0].doc["spec"]
    assert "replicas" not in deployment.doc["spec"], (
        "the HPA owns the replica count: spec.replicas would reset it on every apply"
    )
    args = parse_tokenfleet(container)
    triggers = [t for t in spec["triggers"] if t["type"] == "prometheus" and DESIRED_METRIC in t["metadata"]["query"]]
    assert len(triggers) == 1, f"expected one prometheus trigger on {DESIRED_METRIC}"
    trigger = triggers[0]
    selector = re.search(DESIRED_METRIC + r"\{([^}]*)\}", trigger["metadata"]["query"])
    assert selector, f"the query must select this pool's series: {trigger['metadata']['query']}"
    labels = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', selector.group(1)))
    assert labels.get("pool") == args.pool, f"query selects pool {labels.get('pool')!r}, replicas run {args.pool}"
    assert labels.get("model", args.served_model_name) == args.served_model_name
    # the metric is a replica count: the HPA's desired count is ceil(value / threshold) only for AverageValue
    assert trigger.get("metricType", "AverageValue") == "AverageValue"
    assert float(trigger["metadata"]["threshold"]) == 1.0
    assert trigger["metadata"].get("ignoreNullValues") == "false", (
        "a missing series must be an error (then the fallback), not 0 replicas"
    )
    low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    assert 1 <= low <= high, "never scale a replica pool to zero: a cold start takes minutes"
    fallback = spec.get("fallback")
    assert fallback is not None, "without a fallback a Prometheus outage freezes or misleads scaling"
    assert low <= fallback["replicas"] <= high


@pytest.mark.parametrize("deployment, container", REPLICAS, ids=ids(REPLICAS))
def test_the_gateways_export_the_decision_the_scaledobject_follows(deployment, container, tmp_path, monkeypatch):
    """Without `autoscale: {enabled: true}` no gateway exports the metric, and the ScaledObject sits in fallback."""
    settings = gateway_fleet(tmp_path, monkeypatch).autoscale
    assert settings.enabled, f"fleet.yaml must enable autoscale: the ScaledObject scales on {DESIRED_METRIC}"
    assert settings.orchestrator == "none", "in Kubernetes KEDA starts and stops replicas, not the gateways"
    args = parse_tokenfleet(container)
    pool = settings.pool(pool_key(args.served_model_name, args.pool), args.served_model_name)
    spec = scaled_objects_for(deployment)[0].doc["spec"]
    assert (pool.min_replicas, pool.max_replicas) == (
        spec.get("minReplicaCount", 0),
        spec.get("maxReplicaCount", 100),
    ), "the pool's min_replicas/max_replicas must equal the ScaledObject's minReplicaCount/maxReplicaCount"
