"""The chart's NetworkPolicies as a question: may a pod of one role open a connection to a pod of
another on a port? Roles are the test bed's hosts as the chart deploys them (tests/hosts/bed.py):
`router` (the router Deployment), `redis` (the Redis StatefulSet), `ray` (the head and both
worker groups: KubeRay labels their pods `ray.io/cluster`), `outside` (a user). Kubernetes'
rules: a pod no policy selects accepts everything; a selected pod accepts what one of its
policies' ingress rules allows, a rule without `from` from anyone, without `ports` on any port."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The test bed's hosts as the chart's roles.
ROLE_OF_HOST = {
    "client": "outside",
    "router": "router",
    "redis": "redis",
    "head": "ray",
    "gpu": "ray",
    "cpu": "ray",
}


@dataclass(frozen=True, slots=True)
class Rule:
    """One ingress rule of one policy: who (roles; None: anyone) may reach `to` on which ports
    (None: any)."""

    to: str
    sources: frozenset[str] | None
    ports: frozenset[int] | None


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert not selector.get("matchExpressions"), "the chart's selectors use matchLabels only"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def role_labels(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Each role's pod labels, from the rendered chart."""
    labels: dict[str, dict[str, str]] = {"outside": {}}
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            pod = obj["spec"]["template"]["metadata"]["labels"]
            component = pod.get("app.kubernetes.io/component")
            if component in ("router", "redis"):
                labels[component] = dict(pod)
        elif obj["kind"] == "RayCluster":
            labels["ray"] = {"ray.io/cluster": obj["metadata"]["name"]}
    assert set(labels) == {"outside", "router", "redis", "ray"}, sorted(labels)
    return labels


def ingress_rules(objects: list[dict[str, Any]]) -> tuple[list[Rule], set[str]]:
    """(every ingress rule, the roles some policy selects)."""
    labels = role_labels(objects)
    rules: list[Rule] = []
    selected: set[str] = set()
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        spec = policy["spec"]
        assert spec.get("policyTypes") == ["Ingress"], "the chart's policies are ingress only"
        targets = [r for r, lab in labels.items() if _selects(spec["podSelector"], lab)]
        selected.update(targets)
        for rule in spec.get("ingress", []):
            sources: frozenset[str] | None = None
            if "from" in rule:
                peers = rule["from"]
                sources = frozenset(
                    role
                    for role, lab in labels.items()
                    for peer in peers
                    if "podSelector" in peer
                    and "namespaceSelector" not in peer
                    and _selects(peer["podSelector"], lab)
                )
            ports = (
                frozenset(int(p["port"]) for p in rule["ports"] if p.get("protocol") == "TCP")
                if "ports" in rule
                else None
            )
            rules += [Rule(to, sources, ports) for to in targets]
    return rules, selected


def allowed(rules: list[Rule], selected: set[str], source: str, to: str, port: int) -> bool:
    if to not in selected:
        return True
    return any(
        r.to == to
        and (r.sources is None or source in r.sources)
        and (r.ports is None or port in r.ports)
        for r in rules
    )


def pinned(rules: list[Rule]) -> set[tuple[str, str, int]]:
    """(source, to, port) for each port a rule names for a source it names: what a deployment
    must use, or the chart opens more than it needs."""
    return {
        (source, r.to, port)
        for r in rules
        if r.sources is not None and r.ports is not None
        for source in r.sources
        for port in r.ports
    }
