"""One request over the public API, timed: the HTTP API's server-sent events (as the OpenAI
client streams them) or the gRPC `Generate` stream. Refusals and failures are recorded, never
raised: a load test counts them."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import aiohttp

from load_tests.workload import WorkItem


@dataclass(frozen=True, slots=True)
class Sampling:
    """What every request of a run asks for besides its input."""

    model: str
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    speculation: bool = True
    spec_method: str | None = None
    num_spec_tokens: int | None = None
    timeout_s: float = 300.0
    priority: int | None = None  # the requests' priority (lower first; None: the key's)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be non-negative")
        if self.timeout_s <= 0:
            raise ValueError("timeout must be positive")


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds: `scheduled` and `start` from the
    level's start, `ttft`, `latency` and `chunks` (each streamed piece of text) from `start`."""

    level: str
    api: str
    kind: str
    scheduled: float
    start: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    chunks: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    status: str = "ok"
    error: str | None = None
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    item: int = -1  # the workload's request (WorkItem.index); -1 for a follow-up turn
    turn: int = 1  # its place in its conversation

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict[str, Any]:
        row = asdict(self)
        row["chunks"] = [round(t, 6) for t in self.chunks]
        return row

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> RequestRecord:
        return cls(**row)


class Client(Protocol):
    api: str

    async def send(self, item: WorkItem, record: RequestRecord) -> str:
        """Send `item`, filling in `record`; the text it got back."""
        ...

    async def close(self) -> None: ...


class SseParser:
    """Server-sent events from a byte stream cut anywhere: `feed` returns the data of each event
    completed so far (data lines joined by newlines; comments and other fields skipped)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events = []
        while b"\n" in self._buffer:
            raw, self._buffer = self._buffer.split(b"\n", 1)
            line = raw.rstrip(b"\r").decode()
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
        return events


async def served_model(session: aiohttp.ClientSession, url: str) -> str:
    """The model id a server serves (its `/v1/models`)."""
    async with session.get(url.rstrip("/") + "/v1/models") as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}/v1/models answered {resp.status}: {await resp.text()}")
        return str((await resp.json())["data"][0]["id"])


class HttpClient:
    """Streams each request from `/v1/chat/completions` or `/v1/completions` with usage."""

    api = "http"

    def __init__(self, base_url: str, sampling: Sampling, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.sampling = sampling
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = aiohttp.ClientTimeout(total=sampling.timeout_s)
        # No connection limit: the load level, not the client, decides how many are open.
        connector = aiohttp.TCPConnector(limit=0)
        self._session = aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector)

    def body(self, item: WorkItem) -> dict[str, Any]:
        s = self.sampling
        body: dict[str, Any] = {
            "model": s.model,
            "max_tokens": item.max_tokens or s.max_tokens,
            "temperature": s.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if item.chat:
            body["messages"] = [{"role": r, "content": c} for r, c in item.messages]
        else:
            body["prompt"] = list(item.prompt_ids) if item.prompt_ids else item.prompt
        if s.seed is not None:
            body["seed"] = s.seed
        if s.ignore_eos:
            body["ignore_eos"] = True
        if s.priority is not None:
            body["priority"] = s.priority
        if not s.speculation:
            body["speculative"] = {"enabled": False}
        elif s.spec_method or s.num_spec_tokens:
            spec: dict[str, Any] = {"method": s.spec_method} if s.spec_method else {}
            if s.num_spec_tokens:
                spec["num_speculative_tokens"] = s.num_spec_tokens
            body["speculative"] = spec
        return body

    async def send(self, item: WorkItem, record: RequestRecord) -> str:
        path = "/v1/chat/completions" if item.chat else "/v1/completions"
        text: list[str] = []
        start = time.perf_counter()
        try:
            async with self._session.post(self.base_url + path, json=self.body(item)) as resp:
                if resp.status != 200:
                    record.status = str(resp.status)
                    record.error = _error_message(await resp.text())
                    return ""
                parser, done = SseParser(), False
                async for piece in resp.content.iter_any():
                    for data in parser.feed(piece):
                        if data == "[DONE]":
                            done = True
                        else:
                            event = json.loads(data)
                            text.append(_on_event(event, record, time.perf_counter() - start))
                if not done and record.ok:
                    record.status, record.error = "failed", "the stream ended before [DONE]"
        except TimeoutError:
            record.status, record.error = "timeout", f"no answer in {self.sampling.timeout_s} s"
        except aiohttp.ClientError as exc:
            record.status, record.error = "connection", f"{type(exc).__name__}: {exc}"
        except (ValueError, KeyError, TypeError) as exc:  # not OpenAI's stream format
            record.status, record.error = "bad-response", f"{type(exc).__name__}: {exc}"
        finally:
            record.latency = time.perf_counter() - start
        return "".join(text)

    async def close(self) -> None:
        await self._session.close()


def _on_event(event: dict[str, Any], record: RequestRecord, now: float) -> str:
    """Take one event into `record`; the text it carried."""
    if "error" in event:  # failed after the 200 went out
        record.status = "failed"
        record.error = str(event["error"].get("message", event["error"]))
        return ""
    pieces = []
    for choice in event.get("choices") or []:
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text:
            if record.ttft is None:
                record.ttft = now
            record.chunks.append(now)
            pieces.append(text)
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    if usage := event.get("usage"):
        record.prompt_tokens = int(usage["prompt_tokens"])
        record.output_tokens = int(usage["completion_tokens"])
        spec = usage.get("speculative") or {}
        record.drafted = int(spec.get("drafted", 0))
        record.accepted = int(spec.get("accepted", 0))
        record.verify_steps = int(spec.get("verify_steps", 0))
    return "".join(pieces)


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]


class GrpcClient:
    """Streams each request from `outrider.v1.Generation/Generate`."""

    api = "grpc"

    def __init__(self, target: str, sampling: Sampling, api_key: str | None = None) -> None:
        import grpc

        from router.proto import codegen

        codegen.ensure()
        from router.proto import generate_pb2, generate_pb2_grpc

        self._pb = generate_pb2
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.sampling = sampling

    def request(self, item: WorkItem) -> Any:
        pb, s = self._pb, self.sampling
        fields: dict[str, Any] = {
            "model": s.model,
            "max_tokens": item.max_tokens or s.max_tokens,
            "temperature": s.temperature,
            "ignore_eos": s.ignore_eos,
        }
        if item.chat:
            messages = [pb.ChatMessage(role=r, content=c) for r, c in item.messages]
            fields["chat"] = pb.ChatMessages(messages=messages)
        elif item.prompt_ids:
            fields["prompt_token_ids"] = pb.TokenIds(ids=item.prompt_ids)
        else:
            fields["prompt"] = item.prompt
        if s.seed is not None:
            fields["seed"] = s.seed
        spec = pb.SpeculativeOptions(disabled=not s.speculation)
        if s.speculation and s.spec_method:
            spec.method = s.spec_method
        if s.speculation and s.num_spec_tokens:
            spec.num_speculative_tokens = s.num_spec_tokens
        fields["speculative"] = spec
        return pb.GenerateRequest(**fields)

    async def send(self, item: WorkItem, record: RequestRecord) -> str:
        import grpc

        text: list[str] = []
        start = time.perf_counter()
        call = self._stub.Generate(
            self.request(item), metadata=self._metadata, timeout=self.sampling.timeout_s
        )
        try:
            async for response in call:
                now = time.perf_counter() - start
                if response.text:
                    if record.ttft is None:
                        record.ttft = now
                    record.chunks.append(now)
                    text.append(response.text)
                if response.finished:
                    record.finish_reason = response.finish_reason
                    usage, spec = response.usage, response.usage.speculative
                    record.prompt_tokens = usage.prompt_tokens
                    record.output_tokens = usage.completion_tokens
                    record.drafted, record.accepted = spec.drafted, spec.accepted
                    record.verify_steps = spec.verify_steps
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            deadline = code == grpc.StatusCode.DEADLINE_EXCEEDED
            record.status = "timeout" if deadline else code.name
            record.error = exc.details()
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            record.latency = time.perf_counter() - start
        return "".join(text)

    async def close(self) -> None:
        await self._channel.close()
