"""A small OpenAI-compatible HTTP server over the in-process engine (standard library only).

This is what `make serve` runs until the Ray runtime and the real router exist. It answers
`POST /v1/completions` and `POST /v1/chat/completions` (with or without `"stream": true`),
`GET /v1/models` and `GET /health`, with OpenAI-format errors. Requests run concurrently: each
handler thread submits to one `EngineLoop`, whose engine batches everything running
(continuous batching with speculative decoding). A client that disconnects is aborted.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from workers.engine.config import RequestSpec
from workers.engine.engine_loop import EngineLoop
from workers.engine.factory import LoadedEngine
from workers.engine.llm_engine import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.model.tokenizer import Tokenizer

MAX_BODY_BYTES = 1 << 20
_NUMBER_FIELDS = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "seed": int,
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": None}}


class Service:
    """Turns OpenAI request bodies into engine requests."""

    def __init__(self, loop: Any, tokenizer: Tokenizer, model_name: str) -> None:
        self.loop, self.tokenizer, self.model_name = loop, tokenizer, model_name

    def prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "'messages' must be a non-empty list")
            if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
                raise ApiError(400, "each message needs a string 'content'")
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string")
        return self.tokenizer.encode(prompt)

    def params(self, body: dict[str, Any]) -> SamplingParams:
        model = body.get("model")
        if model not in (None, self.model_name):
            raise ApiError(404, f"model {model!r} does not exist", "not_found_error")
        values: dict[str, Any] = {}
        for name, kind in _NUMBER_FIELDS.items():
            value = body.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ApiError(400, f"'{name}' must be a number")
            if kind is int and value != int(value):
                raise ApiError(400, f"'{name}' must be an integer")
            values[name] = kind(value)
        ignore_eos = body.get("ignore_eos")
        if ignore_eos is not None:
            if not isinstance(ignore_eos, bool):
                raise ApiError(400, "'ignore_eos' must be a boolean")
            values["ignore_eos"] = ignore_eos
        stop = body.get("stop")
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else stop
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise ApiError(400, "'stop' must be a string or a list of strings")
            values["stop"] = tuple(stops)
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc

    @staticmethod
    def spec(body: dict[str, Any]) -> RequestSpec | None:
        """The `speculative` extension field: {"method": ..., "num_speculative_tokens": ...},
        or {"enabled": false}."""
        raw = body.get("speculative")
        if raw is None:
            return None
        if not isinstance(raw, dict) or set(raw) - {"enabled", "method", "num_speculative_tokens"}:
            raise ApiError(400, "'speculative' takes 'enabled', 'method', 'num_speculative_tokens'")
        k = raw.get("num_speculative_tokens")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
            raise ApiError(400, "'speculative.num_speculative_tokens' must be an integer")
        try:
            return RequestSpec(bool(raw.get("enabled", True)), raw.get("method"), k)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc

    def run(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        spec: RequestSpec | None,
    ) -> Iterator[RequestOutput]:
        outputs = self.loop.submit(request_id, prompt_ids, params, spec)
        try:
            first = next(outputs)
        except ValueError as exc:  # rejected by the engine (prompt too long, unknown method)
            raise ApiError(400, str(exc)) from exc
        yield first
        yield from outputs


class Handler(BaseHTTPRequestHandler):
    service: Service  # set on the subclass built by `make_server`
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/ready":  # the engine (or the pools behind it) answers
            ready = getattr(self.service.loop, "ready", lambda: True)()
            if ready:
                self._json(200, {"status": "ready"})
            else:
                error = ApiError(503, "the engine is not reachable", "service_unavailable")
                self._json(503, error.body())
        elif self.path == "/v1/models":
            model = {"id": self.service.model_name, "object": "model", "owned_by": "outrider"}
            self._json(200, {"object": "list", "data": [model]})
        else:
            self._json(404, ApiError(404, f"no route {self.path}", "not_found_error").body())

    def do_POST(self) -> None:
        try:
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                raise ApiError(404, f"no route {self.path}", "not_found_error")
            self._complete(self._read_body(), chat=self.path.endswith("chat/completions"))
        except ApiError as exc:
            self._json(exc.status, exc.body())
        except RuntimeError as exc:  # the engine failed this request; the server carries on
            self._json(500, ApiError(500, str(exc), "server_error").body())

    def _read_body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise ApiError(413, "request body too large")
        try:
            body = json.loads(self.rfile.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, f"body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "body must be a JSON object")
        return body

    def _complete(self, body: dict[str, Any], chat: bool) -> None:
        service = self.service
        params = service.params(body)
        spec = service.spec(body)
        prompt_ids = service.prompt_ids(body, chat)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        outputs = service.run(request_id, prompt_ids, params, spec)
        if body.get("stream"):
            first = next(outputs)  # errors surface before the 200 goes out
            self._stream(request_id, chat, prompt_ids, first, outputs)
            return
        text, last = "", None
        for out in outputs:
            text, last = text + out.text, out
        assert last is not None
        choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        envelope = self._envelope(request_id, chat, [choice])
        envelope["usage"] = _usage(last)
        self._json(200, envelope)

    def _envelope(
        self, request_id: str, chat: bool, choices: list[dict[str, Any]]
    ) -> dict[str, Any]:
        return {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.service.model_name,
            "choices": choices,
        }

    def _stream(
        self,
        request_id: str,
        chat: bool,
        prompt_ids: list[int],
        first: RequestOutput,
        rest: Iterator[RequestOutput],
    ) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        sent_any = False
        try:
            for out in _chain(first, rest):
                if not out.text and not out.finished:
                    continue
                if chat:
                    delta = (
                        {"content": out.text}
                        if sent_any
                        else {"role": "assistant", "content": out.text}
                    )
                    choice = {"index": 0, "delta": delta, "finish_reason": out.finish_reason}
                else:
                    choice = {"index": 0, "text": out.text, "finish_reason": out.finish_reason}
                event = self._envelope(request_id, chat, [choice])
                event["object"] = "chat.completion.chunk" if chat else "text_completion"
                if out.finished:
                    event["usage"] = _usage(out)
                self._event(json.dumps(event))
                sent_any = True
            self._event("[DONE]")
        except (BrokenPipeError, ConnectionResetError):
            self.service.loop.abort(request_id)  # the client left: free its KV blocks now

    def _event(self, data: str) -> None:
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _json(self, status: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def _chain(first: RequestOutput, rest: Iterator[RequestOutput]) -> Iterator[RequestOutput]:
    yield first
    yield from rest


def _usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
        "speculative": out.spec.as_dict(),
    }


def make_server(
    loaded: LoadedEngine, host: str, port: int
) -> tuple[ThreadingHTTPServer, EngineLoop]:
    loop = EngineLoop(loaded.engine)
    return make_server_for(loop, loaded.tokenizer, loaded.model_name, host, port), loop


def make_server_for(
    loop: Any, tokenizer: Tokenizer, model_name: str, host: str, port: int
) -> ThreadingHTTPServer:
    """A server over anything with `EngineLoop`'s submit/abort (the Ray runtime's RuntimeLoop)."""
    service = Service(loop, tokenizer, model_name)
    handler = type("BoundHandler", (Handler,), {"service": service})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def serve(loaded: LoadedEngine, host: str, port: int) -> None:
    server, loop = make_server(loaded, host, port)
    serve_forever(server, loop, loaded.model_name, host, port)


def serve_forever(
    server: ThreadingHTTPServer, loop: Any, model_name: str, host: str, port: int
) -> None:
    print(f"Outrider is serving {model_name} on http://{host}:{port}", flush=True)
    print(
        f"  try: curl http://{host}:{port}/v1/completions -H 'Content-Type: application/json' "
        '-d \'{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}\'',
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        loop.close()
