"""What moving a step's outputs from a verifier actor to the router costs, per output.

`python -m tests.benchmarks.bench_output_channel` starts a local Ray cluster and an actor that
plays a verifier's engine loop without a model: every step it makes one `StreamedStep` for each
of its `n` running requests (a token, its text, the request's statistics), as an engine step
at that load does, and hands them over in the ways a verifier can:
- a Ray streaming generator per request (a yield an output: how `VerifierActor.generate` served
  requests before output channels);
- the client's output channel (cluster/output_channel.py): one message a step for all of them,
  read by the client's `GroupOutputs` thread and handed to each request's `Inbox`, over a Ray
  streaming call (where the client cannot connect to the verifier's host) and over a
  connection of its own (cluster/output_socket.py, what a client that can uses).
The client reads the `n` requests concurrently on one event loop, as the router does. Both run
on the same machine, the actor on one CPU; `us per output` is the wall time of all steps over
the outputs delivered, median of interleaved rounds. Writes its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from cluster.output_channel import Batch, ClientChannel, StreamedStep
from cluster.output_reader import GroupOutputs
from cluster.output_socket import Address, OutputServer
from tests.benchmarks.report import DEFAULT_REPORT, machine_line, table, write_section
from workers.engine.outputs import RequestOutput
from workers.engine.sequence import SpecStats

SIZES = (1, 16, 64, 256)


def _output(request_id: str, step: int) -> StreamedStep:
    out = RequestOutput(request_id, [step % 1000], " word", False, None, 16, step + 1, SpecStats())
    return StreamedStep(out)


class _StepChannel(ClientChannel):
    """A channel whose producer waits for each message to be taken before the next step: one
    step a message, as at a real step's pace (a faster producer would fill a message with
    several steps)."""

    taken: asyncio.Event

    async def batches(self) -> AsyncIterator[Batch]:
        async for batch in super().batches():
            self.taken.set()
            yield batch


class StepActor:
    """Steps of one output for each of `n` requests, handed over as asked; `connect`: whether
    its clients can connect to its output server (else they read through Ray)."""

    def __init__(self, connect: bool) -> None:
        self.channels: dict[str, _StepChannel] = {}
        self.connect = connect
        self.server = OutputServer(self._channel, lambda client, channel: None)

    async def outputs_address(self) -> Address:
        if self.connect:
            return await self.server.address("127.0.0.1")
        with socket.socket() as s:  # bound, never listening: a connection is refused
            s.bind(("127.0.0.1", 0))
            return "127.0.0.1", int(s.getsockname()[1]), b""

    def _channel(self, client: str) -> _StepChannel:
        if client not in self.channels:
            channel = self.channels[client] = _StepChannel()
            channel.taken = asyncio.Event()
        return self.channels[client]

    async def per_request(self, request_id: str, steps: int) -> AsyncIterator[StreamedStep]:
        # Each request is its own generator; the actor's steps run concurrently with them all
        # (asyncio.sleep(0) between yields, as each awaits its queue).
        for step in range(steps):
            yield _output(request_id, step)
            await asyncio.sleep(0)

    async def keep_alive(self, client: str) -> None:
        """What a client's `GroupOutputs` calls every few seconds (nothing to do here)."""

    async def until_closed(self, client: str) -> None:
        """What a client reading over a connection waits on (`VerifierActor.until_closed`)."""
        await self._channel(client).wait_closed()

    async def outputs(self, client: str) -> AsyncIterator[Batch]:
        async for batch in self._channel(client).batches():
            yield batch

    async def run_steps(self, client: str, ids: list[str], steps: int) -> None:
        channel = self._channel(client)
        for step in range(steps):
            channel.taken.clear()
            for request_id in ids:
                channel.put(request_id, _output(request_id, step))
            await channel.taken.wait()  # the step's outputs leave in one message


async def _read_generators(actor: Any, n: int, steps: int) -> float:
    async def read(i: int) -> int:
        gen = actor.per_request.options(num_returns="streaming").remote(f"r{i}", steps)
        count = 0
        async for ref in gen:
            await ref
            count += 1
        return count

    start = time.perf_counter()
    counts = await asyncio.gather(*(read(i) for i in range(n)))
    assert sum(counts) == n * steps
    return time.perf_counter() - start


async def _read_channel(actor: Any, n: int, steps: int) -> float:
    channel = GroupOutputs(actor, "bench")
    ids = [f"r{i}" for i in range(n)]
    inboxes = [channel.register(request_id) for request_id in ids]

    async def read(inbox: Any) -> int:
        for _ in range(steps):
            item = await inbox.get_async()
            assert isinstance(item, StreamedStep)
        return steps

    start = time.perf_counter()
    running = actor.run_steps.remote(channel.client, ids, steps)
    counts = await asyncio.gather(*(read(inbox) for inbox in inboxes))
    await running
    elapsed = time.perf_counter() - start
    channel.close()
    assert sum(counts) == n * steps
    return elapsed


def measure(sizes: tuple[int, ...], outputs: int, rounds: int) -> list[dict[str, Any]]:
    import ray

    # The Ray-stream channel's client warns, each round, that it could not connect.
    logging.getLogger("cluster.output_channel").setLevel(logging.ERROR)
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        step_actor: Any = ray.remote(num_cpus=1)(StepActor).options(max_concurrency=1000)
        connected, through_ray = step_actor.remote(True), step_actor.remote(False)
        ray.get([connected.__ray_ready__.remote(), through_ray.__ray_ready__.remote()])
        results = []
        for n in sizes:
            steps = max(16, outputs // n)
            ways: dict[str, list[float]] = {"generator": [], "ray": [], "connection": []}
            for _ in range(rounds):
                ways["generator"].append(asyncio.run(_read_generators(connected, n, steps)))
                ways["ray"].append(asyncio.run(_read_channel(through_ray, n, steps)))
                ways["connection"].append(asyncio.run(_read_channel(connected, n, steps)))
            per = {k: statistics.median(v) / (n * steps) * 1e6 for k, v in ways.items()}
            results.append(
                {"requests": n, "outputs": n * steps}
                | {f"{way}_us": round(us, 1) for way, us in per.items()}
            )
            print(results[-1])
        return results
    finally:
        ray.shutdown()


def render(results: list[dict[str, Any]], command: str, rounds: int) -> str:
    rows = [
        [
            r["requests"],
            r["outputs"],
            f"{r['generator_us']:.1f}",
            f"{r['ray_us']:.1f}",
            f"{r['connection_us']:.1f}",
            f"{r['ray_us'] / r['connection_us']:.1f}x",
        ]
        for r in results
    ]
    header = [
        "requests at once",
        "outputs",
        "a Ray stream a request (us per output)",
        "channel over a Ray stream (us per output)",
        "channel over its connection (us per output)",
        "connection vs a Ray stream",
    ]
    return (
        "## Outputs from a verifier to the router (`python -m tests.benchmarks."
        "bench_output_channel`)\n\n"
        f"Command: `{command}`. {machine_line()}. A local Ray cluster; an actor (one CPU) "
        "makes one output a step for each of its requests, as a verifier's engine loop does "
        "at that load, without a model; the client reads every request concurrently on one "
        "event loop, as the router does. A Ray streaming generator a request (one yield an "
        "output) against the client's output channel (cluster/output_channel.py: one message "
        "a step for all its requests), over a Ray streaming call and over a connection of its "
        "own (cluster/output_socket.py). Wall time over outputs delivered, median of "
        f"{rounds} interleaved rounds.\n\n" + table(header, rows)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--outputs", type=int, default=4096, help="outputs a size, about")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="16 requests, 256 outputs, 1 round")
    parser.add_argument("--output", type=Path, default=DEFAULT_REPORT)
    args = parser.parse_args()
    sizes, outputs, rounds = ((16,), 256, 1) if args.quick else (SIZES, args.outputs, args.rounds)
    results = measure(sizes, outputs, rounds)
    command = "python -m tests.benchmarks.bench_output_channel" + (" --quick" if args.quick else "")
    text = render(results, command, rounds)
    print(text)
    write_section("bench_output_channel", text, args.output)


if __name__ == "__main__":
    main()
