"""`outrider k8s status|scale`: read and resize a deployed Outrider's RayCluster.

The chart (helm/outrider) deploys one KubeRay `RayCluster` with worker groups named after the
pools: `verifier`, `prefill`, `drafter`. `status` reads the cluster's desired replicas per group
and the state of its pods (KubeRay labels them `ray.io/cluster`, `ray.io/group`,
`ray.io/node-type`); `scale` patches one worker group's `replicas` (raising `maxReplicas` with
it when needed, since KubeRay keeps replicas inside min..max) with a JSON patch that first tests
the group's name, so a concurrent edit of the list fails instead of scaling the wrong group.

The Kubernetes API is reached through the official `kubernetes` client: kubeconfig (or
`--kubeconfig`), else the in-cluster service account. Every API error becomes a `K8sError`
whose message says what to check.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from typing import Any

RAY_GROUP, RAY_VERSION, RAY_PLURAL = "ray.io", "v1", "rayclusters"
CHART_SELECTOR = "app.kubernetes.io/name=outrider"


class K8sError(RuntimeError):
    """Something about the cluster or the request that the user must fix."""


@dataclass(slots=True)
class GroupStatus:
    name: str
    desired: int
    min_replicas: int
    max_replicas: int
    pods: dict[str, int] = field(default_factory=dict)  # phase (or "Ready") -> count
    ready: int = 0


@dataclass(slots=True)
class ClusterStatus:
    name: str
    namespace: str
    state: str  # KubeRay's status.state ("ready", ...), or "unknown"
    head_ready: bool
    groups: list[GroupStatus]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_text(self) -> str:
        lines = [
            f"RayCluster {self.namespace}/{self.name}: {self.state}, "
            f"head {'ready' if self.head_ready else 'not ready'}",
            f"{'pool':<10} {'desired':>7} {'ready':>5}  {'min..max':<9} pods",
        ]
        for g in self.groups:
            pods = ", ".join(f"{n} {phase}" for phase, n in sorted(g.pods.items())) or "none"
            span = f"{g.min_replicas}..{g.max_replicas}"
            lines.append(f"{g.name:<10} {g.desired:>7} {g.ready:>5}  {span:<9} {pods}")
        return "\n".join(lines)


class RayClusterClient:
    """RayCluster reads and patches over a `CustomObjectsApi` and a `CoreV1Api` (or fakes of
    them with the same methods, as the tests use)."""

    def __init__(self, custom_api: Any, core_api: Any, namespace: str) -> None:
        self.custom = custom_api
        self.core = core_api
        self.namespace = namespace

    def find_cluster(self, name: str | None) -> dict[str, Any]:
        """The named RayCluster, or the only Outrider one in the namespace."""
        if name is not None:
            return self._call(
                f"RayCluster {self.namespace}/{name}",
                self.custom.get_namespaced_custom_object,
                RAY_GROUP,
                RAY_VERSION,
                self.namespace,
                RAY_PLURAL,
                name,
            )
        listed = self._call(
            f"RayClusters in namespace {self.namespace}",
            self.custom.list_namespaced_custom_object,
            RAY_GROUP,
            RAY_VERSION,
            self.namespace,
            RAY_PLURAL,
            label_selector=CHART_SELECTOR,
        )
        items = listed.get("items", [])
        if len(items) != 1:
            names = ", ".join(i["metadata"]["name"] for i in items) or "none"
            raise K8sError(
                f"found {len(items)} Outrider RayClusters in namespace {self.namespace} "
                f"({names}); name one with --cluster"
            )
        return items[0]

    def status(self, name: str | None = None) -> ClusterStatus:
        cluster = self.find_cluster(name)
        cluster_name = cluster["metadata"]["name"]
        pods = self._call(
            f"pods of {cluster_name}",
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=f"ray.io/cluster={cluster_name}",
        ).items
        groups = {
            g["groupName"]: GroupStatus(
                g["groupName"],
                int(g.get("replicas", 0)),
                int(g.get("minReplicas", 0)),
                int(g.get("maxReplicas", 0)),
            )
            for g in cluster["spec"].get("workerGroupSpecs", [])
        }
        head_ready = False
        for pod in pods:
            labels = pod.metadata.labels or {}
            ready = _pod_ready(pod)
            if labels.get("ray.io/node-type") == "head":
                head_ready = head_ready or ready
                continue
            group = groups.get(labels.get("ray.io/group", ""))
            if group is None:
                continue
            phase = "Ready" if ready else (pod.status.phase or "Unknown")
            group.pods[phase] = group.pods.get(phase, 0) + 1
            group.ready += ready
        state = (cluster.get("status") or {}).get("state", "unknown")
        return ClusterStatus(cluster_name, self.namespace, state, head_ready, list(groups.values()))

    def scale(self, group: str, replicas: int, name: str | None = None) -> GroupStatus:
        if replicas < 0:
            raise K8sError(f"replicas must be >= 0, got {replicas}")
        cluster = self.find_cluster(name)
        cluster_name = cluster["metadata"]["name"]
        specs = cluster["spec"].get("workerGroupSpecs", [])
        index = next((i for i, g in enumerate(specs) if g["groupName"] == group), None)
        if index is None:
            known = ", ".join(g["groupName"] for g in specs) or "none"
            raise K8sError(f"RayCluster {cluster_name} has no worker group {group!r} ({known})")
        spec = specs[index]
        path = f"/spec/workerGroupSpecs/{index}"
        patch: list[dict[str, Any]] = [
            {"op": "test", "path": f"{path}/groupName", "value": group},
            {"op": "replace", "path": f"{path}/replicas", "value": replicas},
        ]
        min_replicas = int(spec.get("minReplicas", 0))
        max_replicas = int(spec.get("maxReplicas", replicas))
        if replicas > max_replicas:
            patch.append({"op": "replace", "path": f"{path}/maxReplicas", "value": replicas})
            max_replicas = replicas
        if replicas < min_replicas:
            patch.append({"op": "replace", "path": f"{path}/minReplicas", "value": replicas})
            min_replicas = replicas
        self._call(
            f"RayCluster {self.namespace}/{cluster_name}",
            self.custom.patch_namespaced_custom_object,
            RAY_GROUP,
            RAY_VERSION,
            self.namespace,
            RAY_PLURAL,
            cluster_name,
            patch,
        )
        return GroupStatus(group, replicas, min_replicas, max_replicas)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args, **kwargs)
        except ApiException as err:
            if err.status == 404:
                raise K8sError(
                    f"{what}: not found (is the chart installed, and the KubeRay operator with "
                    "its RayCluster CRD?)"
                ) from None
            if err.status in (401, 403):
                raise K8sError(
                    f"{what}: access denied ({err.status} {err.reason}); check your kubeconfig "
                    "context and RBAC"
                ) from None
            if err.status == 422:
                raise K8sError(f"{what}: rejected by the API server: {err.body}") from None
            raise K8sError(f"{what}: API error {err.status} {err.reason}") from None
        except (HTTPError, OSError) as err:
            raise K8sError(f"{what}: cannot reach the Kubernetes API server ({err})") from None


def _pod_ready(pod: Any) -> bool:
    for condition in pod.status.conditions or []:
        if condition.type == "Ready":
            return bool(condition.status == "True")
    return False


def connect(namespace: str | None, kubeconfig: str | None, context: str | None) -> RayClusterClient:
    """A client for the current kubeconfig context (or in-cluster credentials)."""
    try:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException
    except ImportError:
        raise K8sError(
            "the kubernetes client is not installed: pip install 'outrider[k8s]'"
        ) from None
    try:
        config.load_kube_config(config_file=kubeconfig, context=context)
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
        current = active if context is None else next(c for c in contexts if c["name"] == context)
        default_ns = current.get("context", {}).get("namespace", "default")
    except (ConfigException, FileNotFoundError, StopIteration, TypeError) as kube_err:
        try:
            config.load_incluster_config()
        except ConfigException:
            raise K8sError(
                f"no Kubernetes cluster configured: {kube_err} (and not running in a pod); "
                "set KUBECONFIG or pass --kubeconfig"
            ) from None
        default_ns = "default"
    return RayClusterClient(client.CustomObjectsApi(), client.CoreV1Api(), namespace or default_ns)


def add_parser(sub: argparse._SubParsersAction) -> None:
    k8s = sub.add_parser("k8s", help="inspect or scale a deployment on Kubernetes (KubeRay)")
    k8s.add_argument("-n", "--namespace", default=None, help="default: the context's namespace")
    k8s.add_argument("--cluster", default=None, help="RayCluster name (default: the only one)")
    k8s.add_argument("--kubeconfig", default=None)
    k8s.add_argument("--context", default=None, help="kubeconfig context")
    actions = k8s.add_subparsers(dest="k8s_command", required=True)
    status = actions.add_parser("status", help="pool sizes and pod states")
    status.add_argument("--json", action="store_true")
    scale = actions.add_parser("scale", help="set a pool's replicas")
    scale.add_argument("group", help="worker group: verifier, prefill or drafter")
    scale.add_argument("replicas", type=int)


def run(args: argparse.Namespace, client: RayClusterClient | None = None) -> int:
    client = client or connect(args.namespace, args.kubeconfig, args.context)
    if args.k8s_command == "status":
        status = client.status(args.cluster)
        print(json.dumps(status.to_dict()) if args.json else status.to_text())
    else:
        group = client.scale(args.group, args.replicas, args.cluster)
        print(
            f"{group.name}: replicas set to {group.desired} "
            f"(min {group.min_replicas}, max {group.max_replicas})"
        )
    return 0
