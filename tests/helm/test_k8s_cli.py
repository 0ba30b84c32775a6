"""`outrider k8s status|scale` against a local fake of the Kubernetes API.

No API server can run on these machines, so the fake stands in for `CustomObjectsApi` and
`CoreV1Api`: it serves the RayCluster that the chart itself renders, pods built from the
kubernetes client's own model classes, applies JSON patches the way the API server does, and
raises the client's own `ApiException`."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.k8s import K8sError, RayClusterClient, run
from router import cli, cli_args

kubernetes = pytest.importorskip("kubernetes")
helm_python = pytest.importorskip("helm_python")
from kubernetes.client import (  # noqa: E402
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodList,
    V1PodStatus,
)
from kubernetes.client.exceptions import ApiException  # noqa: E402

CHART = Path(__file__).resolve().parents[2] / "helm" / "outrider"


def rendered_raycluster() -> dict[str, Any]:
    chart = helm_python.Chart.load(str(CHART))
    values = yaml.safe_load((CHART / "ci" / "gpu-values.yaml").read_text())
    files = chart.render(values, name="demo", namespace="serving")
    cluster = yaml.safe_load(files["outrider/templates/raycluster.yaml"])
    cluster["metadata"]["namespace"] = "serving"
    cluster["status"] = {"state": "ready"}
    return cluster


def pod(name: str, group: str | None, ready: bool, phase: str = "Running") -> V1Pod:
    labels = {"ray.io/cluster": "demo-outrider-ray"}
    labels.update(
        {"ray.io/node-type": "head"}
        if group is None
        else {"ray.io/node-type": "worker", "ray.io/group": group}
    )
    condition = V1PodCondition(type="Ready", status="True" if ready else "False")
    return V1Pod(
        metadata=V1ObjectMeta(name=name, namespace="serving", labels=labels),
        status=V1PodStatus(phase=phase, conditions=[condition]),
    )


class FakeKube:
    """The few API calls `outrider k8s` makes, over in-memory objects."""

    def __init__(self, clusters: list[dict[str, Any]], pods: list[V1Pod]) -> None:
        self.clusters = {c["metadata"]["name"]: c for c in clusters}
        self.pods = pods
        self.patches: list[list[dict[str, Any]]] = []

    # CustomObjectsApi
    def get_namespaced_custom_object(self, group, version, namespace, plural, name):  # type: ignore[no-untyped-def]
        assert (group, version, plural) == ("ray.io", "v1", "rayclusters")
        if name not in self.clusters or namespace != "serving":
            raise ApiException(status=404, reason="Not Found")
        return copy.deepcopy(self.clusters[name])

    def list_namespaced_custom_object(self, group, version, namespace, plural, label_selector=""):  # type: ignore[no-untyped-def]
        key, value = label_selector.split("=")
        items = [
            copy.deepcopy(c)
            for c in self.clusters.values()
            if namespace == "serving" and c["metadata"]["labels"].get(key) == value
        ]
        return {"apiVersion": "ray.io/v1", "kind": "RayClusterList", "items": items}

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body):  # type: ignore[no-untyped-def]
        cluster = copy.deepcopy(
            self.get_namespaced_custom_object(group, version, namespace, plural, name)
        )
        for op in body:  # RFC 6902, the subset the CLI sends
            *parents, last = op["path"].strip("/").split("/")
            node: Any = cluster
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            if op["op"] == "test" and node[last] != op["value"]:
                raise ApiException(status=422, reason="Unprocessable Entity")
            if op["op"] == "replace":
                node[last] = op["value"]
        self.patches.append(body)
        self.clusters[name] = cluster
        return cluster

    # CoreV1Api
    def list_namespaced_pod(self, namespace, label_selector=""):  # type: ignore[no-untyped-def]
        key, value = label_selector.split("=")
        return V1PodList(items=[p for p in self.pods if p.metadata.labels.get(key) == value])


@pytest.fixture
def kube() -> FakeKube:
    pods = [
        pod("head", None, ready=True),
        pod("verifier-a", "verifier", ready=True),
        pod("verifier-b", "verifier", ready=False, phase="Pending"),
        pod("prefill-a", "prefill", ready=True),
        pod("drafter-a", "drafter", ready=True),
        pod("drafter-b", "drafter", ready=True),
    ]
    return FakeKube([rendered_raycluster()], pods)


def client_for(kube: FakeKube) -> RayClusterClient:
    return RayClusterClient(kube, kube, "serving")


def test_status_reads_pools_and_pod_states(kube: FakeKube) -> None:
    status = client_for(kube).status()
    assert status.name == "demo-outrider-ray"
    assert status.state == "ready" and status.head_ready
    groups = {g.name: g for g in status.groups}
    assert (groups["verifier"].desired, groups["verifier"].ready) == (2, 1)
    assert groups["verifier"].pods == {"Ready": 1, "Pending": 1}
    assert (groups["prefill"].desired, groups["prefill"].ready) == (2, 1)
    assert (groups["drafter"].desired, groups["drafter"].ready) == (2, 2)
    text = status.to_text()
    assert "verifier" in text and "1 Pending" in text


def test_scale_patches_one_group_and_raises_max(kube: FakeKube) -> None:
    client = client_for(kube)
    result = client.scale("drafter", 5)
    assert (result.desired, result.max_replicas) == (5, 5)
    groups = {
        g["groupName"]: g for g in kube.clusters["demo-outrider-ray"]["spec"]["workerGroupSpecs"]
    }
    assert groups["drafter"]["replicas"] == 5 and groups["drafter"]["maxReplicas"] == 5
    assert groups["verifier"]["replicas"] == 2  # untouched
    assert kube.patches[-1][0]["op"] == "test"  # the group's name is checked in the same patch
    client.scale("drafter", 0)
    assert {g.name: g.desired for g in client.status().groups}["drafter"] == 0


def test_clear_errors(kube: FakeKube) -> None:
    client = client_for(kube)
    with pytest.raises(K8sError, match=r"no worker group 'drafters'.*verifier, prefill, drafter"):
        client.scale("drafters", 2)
    with pytest.raises(K8sError, match="replicas must be >= 0"):
        client.scale("drafter", -1)
    with pytest.raises(K8sError, match=r"not found .*KubeRay operator"):
        client.status("missing")
    empty = RayClusterClient(FakeKube([], []), FakeKube([], []), "serving")
    with pytest.raises(K8sError, match="found 0 Outrider RayClusters"):
        empty.status()


def test_cli_runs_status_and_scale(kube: FakeKube, capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli_args.build_parser()
    args = parser.parse_args(["k8s", "-n", "serving", "status", "--json"])
    assert run(args, client_for(kube)) == 0
    out = json.loads(capsys.readouterr().out)
    assert {g["name"] for g in out["groups"]} == {"verifier", "prefill", "drafter"}
    args = parser.parse_args(["k8s", "scale", "drafter", "3"])
    assert run(args, client_for(kube)) == 0
    assert "drafter: replicas set to 3" in capsys.readouterr().out


def test_cli_without_a_cluster_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert cli.main(["k8s", "status"]) == 2
    assert "no Kubernetes cluster configured" in capsys.readouterr().err


def test_unreachable_api_server_is_a_clear_error(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    from cluster.k8s import connect

    client = connect("serving", str(kubeconfig), None)
    with pytest.raises(K8sError, match="cannot reach the Kubernetes API server"):
        client.status("demo")
