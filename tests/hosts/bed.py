"""The system served across separate network hosts (tests/hosts/netns.py), as a Kubernetes
deployment of the chart places it:

| host | runs | as in the chart |
|---|---|---|
| `client` | the load generator (tests/hosts/client.py) | a user, or `helm test`'s pod |
| `router` | `outrider serve`, a Ray Client (`ray://head:10001`) | the router Deployment |
| `redis` | redis-server | the Redis StatefulSet |
| `head` | the Ray head: GCS and the Ray client server, no pool's actors | the RayCluster head |
| `gpu` | a Ray worker node holding the verifier | the GPU worker group |
| `cpu` | a Ray worker node holding the drafter and the prefill worker | the CPU worker group |

`Bed(verifier_hosts=2, prefill_host=True)` (load_tests partitions) adds a second verifier node
(`gpu2`, a verifier group each, a drafter each on `cpu`) and puts the prefill workers (one a
group) on a node of their own (`prefill`) behind a relay, so the prefill-verifier link can be
slowed alone (tests/hosts/relay.py).

Pools find their node by a custom resource each node offers (`verifier_host`, `draft_host`,
`prefill_host`).
Every Ray process authenticates with one token (RAY_AUTH_TOKEN, as the chart's Secret gives
it). The deployment is fp32 over float weights, EAGLE drafting from the drafter pool and every
prompt prefilled on the prefill worker: hidden states cross `cpu`-`gpu` every round, a prompt's
KV cache once per request, and greedy text is plain decoding's."""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from router.redis_server import find_binary
from tests.hosts.netns import Connection, Network

HOSTS = ["client", "router", "redis", "head", "gpu", "cpu"]
RAY_PORT = 6379
RAY_CLIENT_PORT = 10001
REDIS_PORT = 6379
HTTP_PORT = 8000
WATCH_EVERY_S = 1.0  # how often a load looks at the connections between hosts
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@dataclass(slots=True)
class Partition:
    """A `during` for `Bed.load`: `host` cut off `at_s` seconds into the load for `down_s`."""

    network: Network
    host: str
    at_s: float
    down_s: float
    cut_at: float | None = None  # when it was cut, into the load
    mended_at: float | None = None

    def __call__(self, elapsed_s: float) -> None:
        if elapsed_s >= self.at_s and self.cut_at is None:
            self.network.cut(self.host)
            self.cut_at = elapsed_s
        if elapsed_s >= self.at_s + self.down_s and self.mended_at is None:
            self.mend(elapsed_s)

    def mend(self, elapsed_s: float = float("nan")) -> None:
        """Mend the host now if the load ended before it was (idempotent)."""
        if self.mended_at is None:
            self.network.mend(self.host)
            self.mended_at = elapsed_s


@dataclass(frozen=True, slots=True)
class Load:
    rows: list[dict[str, Any]]  # tests/hosts/client.py's, a request each
    connections: set[Connection]  # between two hosts, seen open while it ran


def deployment_config(verifier_groups: int = 1, prefill_host: bool = False) -> dict[str, Any]:
    """A drafter for each verifier group (each group has its own share of the pools); a
    prefill worker each too on a prefill node, one for all on the drafter node."""
    return {
        "dtype": "float32",
        "quantization": "none",
        "engine": {"max_model_len": 512},
        "speculative": {"method": "eagle", "num_speculative_tokens": 4, "adaptive": False},
        "pools": {
            "prefill": {
                "replicas": verifier_groups if prefill_host else 1,
                "min_remote_prompt_tokens": 1,
                "resources": {
                    "cpus": 1,
                    "custom": {"prefill_host" if prefill_host else "draft_host": 1},
                },
            },
            "verifier": {
                "groups": verifier_groups,
                "resources": {"cpus": 1, "custom": {"verifier_host": 1}},
            },
            "drafter": {
                "replicas": verifier_groups,
                "method": "eagle",
                "resources": {"cpus": 1, "custom": {"draft_host": 1}},
            },
        },
        "router": {"migration": {"max_wait_s": 60.0}},
    }


class Bed:
    """Start with `start()`; `close()` (or the context manager) removes everything."""

    def __init__(
        self, workdir: Path | None = None, verifier_hosts: int = 1, prefill_host: bool = False
    ) -> None:
        """`verifier_hosts` > 1: more verifier nodes (`gpu2`, ...), a verifier group each.
        `prefill_host`: the prefill worker on a node of its own (`prefill`), behind a relay,
        so `network.impair("prefill", "gpu", ...)` slows the prefill-verifier link alone."""
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="outrider-hosts-"))
        self.verifier_hosts = ["gpu", *(f"gpu{i + 1}" for i in range(1, verifier_hosts))]
        self.prefill_host = prefill_host
        extra = ["prefill"] if prefill_host else []
        self.network = Network(HOSTS + self.verifier_hosts[1:] + extra, wired=extra)
        self.env = {
            "PATH": f"{BIN}:/usr/local/bin:/usr/bin:/bin",
            "HOME": os.environ.get("HOME", "/root"),
            "PYTHONPATH": str(REPO),
            "HF_HUB_OFFLINE": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(16),
            "OMP_NUM_THREADS": "1",
        }
        if "OUTRIDER_CACHE_DIR" in os.environ:  # the tests' own cache of converted weights
            self.env["OUTRIDER_CACHE_DIR"] = os.environ["OUTRIDER_CACHE_DIR"]

    def __enter__(self) -> Bed:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def address(self, host: str) -> str:
        return self.network[host].address

    @property
    def url(self) -> str:
        return f"http://{self.address('router')}:{HTTP_PORT}"

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    # -- starting -------------------------------------------------------------------------------

    def start(self, ready_timeout_s: float = 300.0) -> None:
        net = self.network
        net["redis"].spawn(
            [
                find_binary(),
                "--bind",
                self.address("redis"),
                "--port",
                str(REDIS_PORT),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
            ],
            self.env,
            self.log("redis"),
        )
        head = self.address("head")
        ray_dir = self.workdir / "ray"
        net["head"].run(
            [
                str(BIN / "ray"),
                "start",
                "--head",
                f"--node-ip-address={head}",
                f"--port={RAY_PORT}",
                f"--ray-client-server-port={RAY_CLIENT_PORT}",
                "--num-cpus=0",
                "--include-dashboard=false",
                "--disable-usage-stats",
                f"--temp-dir={ray_dir}",
            ],
            self.env,
            timeout_s=120,
        )
        # A verifier group a verifier node; the drafter and the prefill worker on `cpu`, or
        # the prefill worker on `prefill`.
        nodes = [(h, {"verifier_host": 1}) for h in self.verifier_hosts]
        groups = len(self.verifier_hosts)
        nodes.append(("cpu", {"draft_host": groups + (not self.prefill_host)}))
        if self.prefill_host:
            nodes.append(("prefill", {"prefill_host": groups}))
        # The worker nodes join side by side (each `ray start` is seconds of imports).
        with ThreadPoolExecutor(len(nodes)) as pool:
            joins = [
                pool.submit(
                    net[host].run,
                    [
                        str(BIN / "ray"),
                        "start",
                        f"--address={head}:{RAY_PORT}",
                        f"--node-ip-address={self.address(host)}",
                        "--num-cpus=2",
                        f"--resources={json.dumps(resources)}",
                        f"--temp-dir={self.workdir / f'ray-{host}'}",
                    ],
                    self.env,
                    timeout_s=120,
                )
                for host, resources in nodes
            ]
            for join in joins:
                join.result()
        config = self.workdir / "deployment.yaml"
        config.write_text(yaml.safe_dump(deployment_config(groups, self.prefill_host)))
        self.router = net["router"].spawn(
            [
                str(BIN / "outrider"),
                "serve",
                "--config",
                str(config),
                "--address",
                f"ray://{head}:{RAY_CLIENT_PORT}",
                "--redis-url",
                f"redis://{self.address('redis')}:{REDIS_PORT}/0",
                "--host",
                self.address("router"),
                "--port",
                str(HTTP_PORT),
                "--no-grpc",
            ],
            self.env,
            self.log("router"),
            cwd=str(REPO),
        )
        self.wait_ready(ready_timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        """Until the router answers /ready (asked from the client host, as a user would)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"the router exited:\n{self.tail('router')}")
            probe = [
                sys.executable,
                "-c",
                "import sys, urllib.request as u; "
                f"sys.exit(0 if u.urlopen('{self.url}/ready', timeout=2).status == 200 else 1)",
            ]
            try:
                self.network["client"].run(probe, self.env, timeout_s=10)
                return
            except (RuntimeError, TimeoutError):
                time.sleep(2.0)
        raise TimeoutError(f"the router was not ready in {timeout_s} s:\n{self.tail('router')}")

    def tail(self, name: str, chars: int = 4000) -> str:
        path = self.log(name)
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    # -- load -----------------------------------------------------------------------------------

    def load(
        self,
        prompts: list[str],
        requests: int,
        concurrency: int,
        max_tokens: int,
        during: Callable[[float], None] | None = None,
    ) -> Load:
        """Send the prompts round robin from the client host (tests/hosts/client.py), noting
        every connection between two hosts seen open while it runs; `during` is called about
        every `WATCH_EVERY_S` with the seconds since the load started (to cut a host off)."""
        spec = self.workdir / f"load-{time.monotonic_ns()}.json"
        spec.write_text(json.dumps({"prompts": prompts}))
        out = spec.with_suffix(".out.json")
        argv = [
            sys.executable,
            "-m",
            "tests.hosts.client",
            *("--url", self.url, "--prompts", str(spec), "--out", str(out)),
            *("--requests", str(requests), "--concurrency", str(concurrency)),
            *("--max-tokens", str(max_tokens)),
        ]
        log = self.log("client")
        client = self.network["client"].spawn(argv, self.env, log, cwd=str(REPO))
        seen: set[Connection] = set()
        started = time.monotonic()
        while client.poll() is None and time.monotonic() - started < 600:
            if during is not None:
                during(time.monotonic() - started)
            seen |= self.network.connections()
            time.sleep(WATCH_EVERY_S)
        if client.returncode != 0:
            raise RuntimeError(f"the load generator failed:\n{self.tail('client')}")
        return Load(json.loads(out.read_text()), seen)

    def close(self) -> None:
        self.network.close()
