"""The Helm chart, rendered with the real Helm SDK (no cluster): every object valid against
Kubernetes' own schemas (kubernetes-validate, offline) and the RayCluster against KubeRay's CRD;
the wiring that matters checked; bad values refused by values.schema.json at render time."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from cluster.config import from_dict

helm_python = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

HELM = Path(__file__).resolve().parents[2] / "helm"
CHART = HELM / "outrider"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
KUBERNETES_VERSION = "1.30.0"
# Custom resources: validated by their own schema (RayCluster) or skipped (Prometheus Operator's
# ServiceMonitor, whose CRD is not vendored here; its fields are asserted below instead).
CUSTOM_KINDS = {"RayCluster", "ServiceMonitor", "PodMonitor"}
DASHBOARD = CHART / "dashboards" / "outrider.json"


@pytest.fixture(scope="module")
def chart() -> Any:
    return helm_python.Chart.load(str(CHART))


@pytest.fixture(scope="module")
def raycluster_schema() -> dict[str, Any]:
    crd = yaml.safe_load((HELM / "schemas" / "ray.io_rayclusters.yaml").read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def load_values(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def render(chart: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    files = chart.render(values, name="demo", namespace="serving")
    objects = []
    for path, text in files.items():
        if path.endswith(".yaml"):
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in by_kind(objects, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def deployment_of(objects: list[dict[str, Any]]) -> Any:
    """The deployment config in the chart's ConfigMap, as Outrider reads it."""
    config_map = one(objects, "ConfigMap", "demo-outrider-config")
    return from_dict(yaml.safe_load(config_map["data"]["outrider.yaml"]))


def worker_groups(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    cluster = one(objects, "RayCluster")
    return {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}


def container(pod_template: dict[str, Any]) -> dict[str, Any]:
    return pod_template["spec"]["containers"][0]


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.name)
def test_ci_values_render_valid_objects(chart, raycluster_schema, values_file: Path) -> None:  # type: ignore[no-untyped-def]
    values = load_values(values_file)
    lint = helm_python.lint(str(CHART), values)
    assert lint["errors"] == [], lint
    objects = render(chart, values)
    kinds = {o["kind"] for o in objects}
    assert {"RayCluster", "ConfigMap", "Deployment", "Service", "Secret"} <= kinds
    for obj in objects:
        if obj["kind"] == "RayCluster":
            jsonschema.validate(obj, raycluster_schema)
        elif obj["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    # The ConfigMap holds a deployment config that Outrider itself accepts, matching the pools.
    config = deployment_of(objects)
    groups = worker_groups(objects)
    assert groups["verifier"]["replicas"] == config.pools.verifier.groups
    assert config.pools.verifier.tensor_parallel_size == values.get("verifier", {}).get(
        "tensorParallelSize", 1
    )
    assert ("prefill" in groups) == (config.pools.prefill.replicas > 0)


def test_gpu_counts_per_pool_follow_tensor_parallel_size(chart) -> None:  # type: ignore[no-untyped-def]
    objects = render(chart, load_values(CHART / "ci" / "gpu-values.yaml"))
    groups = worker_groups(objects)
    verifier = container(groups["verifier"]["template"])["resources"]
    assert verifier["limits"]["nvidia.com/gpu"] == 4  # tensorParallelSize 4 x 1 GPU per rank
    assert verifier["requests"]["nvidia.com/gpu"] == 4
    assert groups["verifier"]["replicas"] == 2
    assert groups["verifier"]["rayStartParams"]["resources"] == '"{\\"outrider_verifier\\":4}"'
    prefill = container(groups["prefill"]["template"])["resources"]
    assert prefill["limits"]["nvidia.com/gpu"] == 1
    assert groups["prefill"]["replicas"] == 2
    drafter = container(groups["drafter"]["template"])["resources"]
    assert "nvidia.com/gpu" not in drafter.get("limits", {})
    assert groups["drafter"]["rayStartParams"]["num-gpus"] == "0"
    tolerations = groups["verifier"]["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations

    cpu = render(chart, load_values(CHART / "ci" / "cpu-values.yaml"))
    for group in worker_groups(cpu).values():
        resources = container(group["template"])["resources"]
        assert "nvidia.com/gpu" not in resources.get("limits", {})


def test_grace_drafters_select_arm64_nodes_and_advertise_the_resource(chart) -> None:  # type: ignore[no-untyped-def]
    objects = render(chart, load_values(CHART / "ci" / "grace-values.yaml"))
    drafter = worker_groups(objects)["drafter"]
    selector = drafter["template"]["spec"]["nodeSelector"]
    assert selector["kubernetes.io/arch"] == "arm64"
    assert selector["nvidia.com/gpu.family"] == "grace-blackwell"
    assert drafter["rayStartParams"]["resources"] == (
        '"{\\"grace_cpu\\":2,\\"outrider_drafter\\":2}"'
    )
    config = deployment_of(objects)
    assert config.pools.drafter.resources.custom == {"grace_cpu": 1.0, "outrider_drafter": 1.0}
    assert config.pools.drafter.replicas == 4  # 2 pods x 2 actors
    assert config.pools.drafter.draft_ahead  # the chart's defaults
    assert config.pools.drafter.keep_drafting_ahead
    values = load_values(CHART / "ci" / "grace-values.yaml")
    values["drafter"] = {**values["drafter"], "draftAhead": False, "keepDraftingAhead": False}
    objects = render(chart, values)
    rendered = one(objects, "ConfigMap", "demo-outrider-config")["data"]["outrider.yaml"]
    off = from_dict(yaml.safe_load(rendered))
    assert not off.pools.drafter.draft_ahead and not off.pools.drafter.keep_drafting_ahead
    # over the chart's defaults
    values["speculative"] = {
        "ngramMin": 3,
        "ngramMax": 5,
        "ngramFallbackTokens": 2,
        "minDraftConfidence": 0.25,
    }
    sized = one(render(chart, values), "ConfigMap", "demo-outrider-config")["data"]["outrider.yaml"]
    speculative = from_dict(yaml.safe_load(sized)).speculative
    assert (speculative.ngram_min, speculative.ngram_max) == (3, 5)
    assert speculative.ngram_fallback_tokens == 2
    assert speculative.min_draft_confidence == 0.25
    assert speculative.method == "eagle"  # the rest of the chart's speculative defaults stay
    assert "prefill" not in worker_groups(objects)  # prefill replicas 0: verifiers prefill
    # Without grace, drafters are not pinned to arm64.
    cpu = render(chart, load_values(CHART / "ci" / "cpu-values.yaml"))
    assert "nodeSelector" not in worker_groups(cpu)["drafter"]["template"]["spec"]


def test_router_probes_service_and_secrets(chart) -> None:  # type: ignore[no-untyped-def]
    objects = render(chart, load_values(CHART / "ci" / "cpu-values.yaml"))
    router = one(objects, "Deployment")
    c = container(router["spec"]["template"])
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    secrets = {s["metadata"]["name"]: s for s in by_kind(objects, "Secret")}
    env = {e["name"]: e for e in c["env"]}
    redis_ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert redis_ref["name"] in secrets
    assert redis_ref["key"] in secrets[redis_ref["name"]]["data"]
    token_ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token_ref == {"name": "demo-outrider-ray-auth", "key": "auth_token"}
    assert one(objects, "RayCluster")["spec"]["authOptions"] == {
        "mode": "token",
        "secretName": "demo-outrider-ray-auth",
    }
    keys_volume = [v for v in router["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    keys_secret = secrets[keys_volume[0]["secret"]["secretName"]]
    assert base64.b64decode(keys_secret["data"]["api-keys"]).split() == [b"sk-ci-test-key"]
    assert env["RAY_ADDRESS"]["value"] == "ray://demo-outrider-ray-head-svc:10001"
    assert c["command"][:4] == ["outrider", "serve", "--config", "/etc/outrider/outrider.yaml"]
    config = deployment_of(objects)
    assert config.ray.address == "ray://demo-outrider-ray-head-svc:10001"
    # A rollout lets a router drain: Kubernetes waits past the router's own grace period.
    assert config.router.shutdown_grace_s == 30
    assert (config.router.migration.max_wait_s, config.router.migration.max_attempts) == (90, 3)
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 45
    service = one(objects, "Service", "demo-outrider")
    assert service["spec"]["type"] == "ClusterIP"
    assert {p["name"] for p in service["spec"]["ports"]} == {"http", "grpc"}
    assert not by_kind(objects, "HorizontalPodAutoscaler")  # autoscaling off in this file
    assert one(objects, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    statefulset = one(objects, "StatefulSet")
    assert "volumeClaimTemplates" not in statefulset["spec"]  # persistence off
    ray_head = one(objects, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}} in ray_head[
        "volumes"
    ]


def test_helm_test_pod_sends_a_load_through_the_router_service(chart) -> None:  # type: ignore[no-untyped-def]
    from load_tests.__main__ import parser

    objects = render(chart, load_values(CHART / "ci" / "cpu-values.yaml"))
    pod = one(objects, "Pod", "demo-outrider-load-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    c = container(pod)
    assert c["image"] == container(one(objects, "Deployment")["spec"]["template"])["image"]
    assert c["command"][:4] == ["python", "-m", "load_tests", "run"]
    # The arguments are the load generator's own: they parse, and name the Service's HTTP port.
    args = parser().parse_args(c["command"][3:])
    service = one(objects, "Service", "demo-outrider")
    (http,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "http"]
    assert args.url == f"http://demo-outrider:{http}"
    assert (args.concurrency, args.requests, args.max_refused) == ([1, 4], 8, 0)
    assert args.metrics_url == ["none"]
    # The key comes from the Secret the routers read their keys from.
    router_spec = one(objects, "Deployment")["spec"]["template"]["spec"]
    (router_keys,) = [v for v in router_spec["volumes"] if "secret" in v]
    (pod_keys,) = [v for v in pod["spec"]["volumes"] if "secret" in v]
    assert pod_keys["secret"] == router_keys["secret"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "api-keys"]
    assert str(args.api_keys_file).startswith(mount["mountPath"] + "/")
    open_router = render(chart, {"router": {"apiKeys": {"enabled": False}}})
    command = container(one(open_router, "Pod"))["command"]
    assert "--api-keys-file" not in command
    assert not by_kind(render(chart, {"loadTest": {"enabled": False}}), "Pod")


def test_gpu_values_use_existing_secrets_external_redis_and_lockdown(chart) -> None:  # type: ignore[no-untyped-def]
    objects = render(chart, load_values(CHART / "ci" / "gpu-values.yaml"))
    secret_names = {s["metadata"]["name"] for s in by_kind(objects, "Secret")}
    assert secret_names == {"demo-outrider-ray-auth"}  # Redis and API keys: existing Secrets
    assert not by_kind(objects, "StatefulSet")
    config = deployment_of(objects)
    assert config.redis.url == "rediss://redis.example.internal:6380/0"
    assert config.redis.tls
    assert config.router.log_format == "json"  # for the cluster's log collector
    assert config.telemetry.otlp_endpoint == "http://otel-collector.observability:4317"
    assert not config.engine.deterministic  # the fast kernels unless asked
    values = load_values(CHART / "ci" / "gpu-values.yaml")
    values.setdefault("engine", {}).update(deterministic=True, asyncScheduling=True)
    switched = deployment_of(render(chart, values)).engine_config()
    assert switched.deterministic and switched.async_scheduling
    env = {e["name"]: e for e in container(one(objects, "Deployment")["spec"]["template"])["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "outrider-redis"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == config.telemetry.otlp_endpoint
    # Exposed through a load balancer: over TLS only, without the API's docs.
    assert one(objects, "Service", "demo-outrider")["spec"]["type"] == "LoadBalancer"
    assert config.router.tls.cert_file == "/etc/outrider-tls/tls.crt" and not config.router.docs
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "demo-outrider-router"
    monitor = one(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    policy = one(objects, "NetworkPolicy", "demo-outrider-ray")
    pods, routers, monitoring = policy["spec"]["ingress"]
    ray_pods = {"podSelector": {"matchLabels": {"ray.io/cluster": "demo-outrider-ray"}}}
    assert pods == {"from": [ray_pods]}
    (router,) = routers["from"]
    assert router["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert routers["ports"] == [{"port": 10001, "protocol": "TCP"}]  # Ray's client port only
    assert {p["port"] for p in monitoring["ports"]} == {8265, 8080}


def _pod_specs(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod spec the chart renders, by where it comes from."""
    specs = {}
    for o in objects:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("Deployment", "StatefulSet"):
            specs[name] = o["spec"]["template"]["spec"]
        elif o["kind"] == "Pod":
            specs[name] = o["spec"]
        elif o["kind"] == "RayCluster":
            specs[name + "/head"] = o["spec"]["headGroupSpec"]["template"]["spec"]
            for group in o["spec"]["workerGroupSpecs"]:
                specs[f"{name}/{group['groupName']}"] = group["template"]["spec"]
    return specs


def test_default_values_lock_every_pod_down(chart) -> None:  # type: ignore[no-untyped-def]
    """helm template with the defaults: every pod non-root under seccomp's default, every
    container without capabilities or privilege escalation, read-only roots where they can
    be; Redis as its own user, its password in no command line, its memory bounded; network
    policies on; the API behind a ClusterIP Service without its docs."""
    objects = render(chart, {})
    specs = _pod_specs(objects)
    assert len(specs) == 7  # router, Redis, the test pod, Ray's head and three worker groups
    for name, spec in specs.items():
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] and pod["runAsUser"] > 0, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in spec["containers"]:
            context = c["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"] == {"drop": ["ALL"]}, name
    for name in ("Deployment/demo-outrider-router", "StatefulSet/demo-outrider-redis"):
        assert container({"spec": specs[name]})["securityContext"]["readOnlyRootFilesystem"]
    redis = container({"spec": specs["StatefulSet/demo-outrider-redis"]})
    assert specs["StatefulSet/demo-outrider-redis"]["securityContext"]["runAsUser"] == 999
    assert "requirepass" not in redis["command"][-1].split("printf")[0]
    assert redis["command"][-1].endswith("exec redis-server /etc/redis/redis.conf")
    conf = one(objects, "ConfigMap", "demo-outrider-redis")["data"]["redis.conf"].splitlines()
    assert {"maxmemory 384mb", "maxmemory-policy volatile-lru"} <= set(conf)
    assert "include /run/redis/auth.conf" in conf
    probe = redis["readinessProbe"]["exec"]["command"]
    assert "-a" not in " ".join(probe).split()  # the password comes from REDISCLI_AUTH
    policies = {p["metadata"]["name"]: p for p in by_kind(objects, "NetworkPolicy")}
    assert set(policies) == {"demo-outrider-ray", "demo-outrider-redis"}
    (redis_from,) = policies["demo-outrider-redis"]["spec"]["ingress"]
    selectors = [s["podSelector"]["matchLabels"] for s in redis_from["from"]]
    assert {"ray.io/cluster": "demo-outrider-ray"} in selectors  # the n-gram pool's followers
    assert one(objects, "Service", "demo-outrider")["spec"]["type"] == "ClusterIP"
    config = deployment_of(objects)
    assert not config.router.docs and config.router.tls.cert_file is None
    digest = "sha256:" + "ab" * 32
    pinned = render(chart, {"image": {"digest": digest}})
    images = {c["image"] for spec in _pod_specs(pinned).values() for c in spec["containers"]}
    assert f"ghcr.io/outrider-project/outrider@{digest}" in images
    assert not any(i.startswith("ghcr.io/outrider-project/outrider:") for i in images)


def test_tls_from_a_secret_reaches_router_probes_and_the_test_pod(chart) -> None:  # type: ignore[no-untyped-def]
    values = {"router": {"tls": {"enabled": True, "secretName": "outrider-tls"}}}
    objects = render(chart, values)
    router = one(objects, "Deployment")["spec"]["template"]["spec"]
    (tls,) = [v for v in router["volumes"] if v["name"] == "tls"]
    assert tls["secret"]["secretName"] == "outrider-tls"
    c = container({"spec": router})
    assert {"name": "tls", "mountPath": "/etc/outrider-tls", "readOnly": True} in c["volumeMounts"]
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    config = deployment_of(objects)
    assert (config.router.tls.cert_file, config.router.tls.key_file) == (
        "/etc/outrider-tls/tls.crt",
        "/etc/outrider-tls/tls.key",
    )
    pod = container(one(objects, "Pod"))
    assert pod["command"][pod["command"].index("--url") + 1].startswith("https://")
    assert {"name": "SSL_CERT_FILE", "value": "/etc/outrider-tls/ca.crt"} in pod["env"]
    with pytest.raises(Exception, match="secretName"):
        render(chart, {"router": {"tls": {"enabled": True}}})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"verifier": {"tensorParallelSize": 3}}, "/verifier/tensorParallelSize"),
        ({"router": {"service": {"type": "Ingress"}}}, "/router/service/type"),
        ({"router": {"shutdownGraceSeconds": -5}}, "/router/shutdownGraceSeconds"),
        ({"router": {"migration": {"maxAttempts": -1}}}, "/router/migration/maxAttempts"),
        ({"drafter": {"replicas": -1}}, "/drafter/replicas"),
        ({"drafter": {"draftAhead": "yes"}}, "/drafter/draftAhead"),
        ({"speculative": {"method": "medusa"}}, "/speculative/method"),
        ({"dtype": "int4"}, "/dtype"),
        ({"loadTest": {"concurrency": [0]}}, "/loadTest/concurrency/0"),
        ({"replicaCount": 3}, "replicaCount"),
        ({"redis": {"enabled": False}}, "/redis/externalUrl"),
        ({"redis": {"externalUrl": "http://redis:6379"}}, "/redis/externalUrl"),
        ({"drafter": {"grace": {"resourceName": "grace cpu"}}}, "/drafter/grace/resourceName"),
        ({"sharedMemorySize": "lots"}, "/sharedMemorySize"),
    ],
)
def test_bad_values_are_rejected_with_the_field_named(chart, override, message: str) -> None:  # type: ignore[no-untyped-def]
    values = load_values(CHART / "ci" / "cpu-values.yaml")
    for key, value in override.items():
        merged = dict(values.get(key, {})) if isinstance(value, dict) else value
        if isinstance(value, dict):
            merged.update(value)
        values[key] = merged
    with pytest.raises(helm_python.HelmValuesError) as err:
        chart.render(values, name="demo", namespace="serving")
    assert message in str(err.value)


def test_default_values_render_with_a_generated_api_key(chart) -> None:  # type: ignore[no-untyped-def]
    objects = render(chart, {})
    keys = one(objects, "Secret", "demo-outrider-api-keys")
    (key,) = base64.b64decode(keys["data"]["api-keys"]).decode().split()
    assert key.startswith("sk-") and len(key) == 43
    for obj in objects:
        if obj["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def exported_metric_names() -> set[str]:
    """Every series name the routers (their /metrics) and the engine actors (Ray's metrics
    endpoint) export, as Prometheus scrapes them."""
    from cluster.engine_metrics import ALL
    from router.metrics import RouterMetrics

    names = {series for spec in ALL for series in spec.series()}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for family in RouterMetrics().registry.collect():
        names |= {family.name + suffix for suffix in suffixes[family.type]}
    return names


def test_the_grafana_dashboard_queries_only_exported_metrics() -> None:
    import json
    import re

    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    queried = {name for expr in exprs for name in re.findall(r"\b(?:ray_)?outrider_\w+", expr)}
    assert len(exprs) >= 30 and len(queried) >= 40
    assert sorted(queried - exported_metric_names()) == []
    # The docs' copy is the chart's file.
    docs_copy = CHART.parents[1] / "docs" / "grafana" / "outrider.json"
    assert docs_copy.read_text() == DASHBOARD.read_text()


def test_dashboard_configmap_and_pod_monitor_render_when_switched_on(chart) -> None:  # type: ignore[no-untyped-def]
    import json

    assert not by_kind(render(chart, {}), "PodMonitor")
    assert [o["metadata"]["name"] for o in by_kind(render(chart, {}), "ConfigMap")] == [
        "demo-outrider-config",
        "demo-outrider-redis",
    ]
    objects = render(chart, load_values(CHART / "ci" / "gpu-values.yaml"))
    board = one(objects, "ConfigMap", "demo-outrider-grafana-dashboard")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert board["metadata"]["annotations"] == {"grafana_folder": "Outrider"}
    assert json.loads(board["data"]["outrider.json"]) == json.loads(DASHBOARD.read_text())
    monitor = one(objects, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    components = monitor["spec"]["selector"]["matchExpressions"][0]["values"]
    cluster = one(objects, "RayCluster")["spec"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:  # every Ray pod serves Ray's metrics on the port the monitor scrapes
        labels = group["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] in components
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
        ports = {p["name"]: p["containerPort"] for p in container(group["template"])["ports"]}
        assert ports["metrics"] == 8080


def test_a_drafter_head_model_and_users_class_reach_the_deployment_config(chart) -> None:  # type: ignore[no-untyped-def]
    values = load_values(CHART / "ci" / "cpu-values.yaml")
    values["speculative"] = {**values.get("speculative", {}), "method": "acme.drafting:MyDrafter"}
    values["drafter"] = {
        **values.get("drafter", {}),
        "method": "eagle",
        "eagleHead": "/models/llama3.1-eagle3",
        "draftModel": "",
    }
    config = deployment_of(render(chart, values))
    assert config.speculative.method == "acme.drafting:MyDrafter"
    assert config.pools.drafter.eagle_head == "/models/llama3.1-eagle3"
    assert config.pools.drafter.draft_model is None
    values["drafter"]["method"] = "acme drafting"
    with pytest.raises(helm_python.HelmValuesError) as err:
        chart.render(values, name="demo", namespace="serving")
    assert "/drafter/method" in str(err.value)
