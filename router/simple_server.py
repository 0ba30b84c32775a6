"""A small OpenAI-compatible HTTP server over the in-process engine (standard library only).

This is what `make serve` runs until the Ray runtime and the real router exist: it answers
`POST /v1/completions` and `POST /v1/chat/completions` (with or without `"stream": true`),
`GET /v1/models` and `GET /health`, one generation at a time, with OpenAI-format errors.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine
from workers.model.tokenizer import Tokenizer

MAX_BODY_BYTES = 1 << 20


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": None}}


class Service:
    """Turns OpenAI request bodies into engine calls; one generation at a time."""

    def __init__(self, engine: SequentialEngine, tokenizer: Tokenizer, model_name: str) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self._lock = threading.Lock()

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
        fields = {
            "max_tokens": int,
            "temperature": float,
            "top_p": float,
            "top_k": int,
            "min_p": float,
            "seed": int,
        }
        values: dict[str, Any] = {}
        for name, kind in fields.items():
            value = body.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ApiError(400, f"'{name}' must be a number")
            if kind is int and value != int(value):
                raise ApiError(400, f"'{name}' must be an integer")
            values[name] = kind(value)
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc

    def run(
        self, prompt_ids: list[int], params: SamplingParams, on_tokens: Callable[[list[int]], None]
    ) -> tuple[list[int], str]:
        with self._lock:
            try:
                result = self.engine.generate(prompt_ids, params, on_tokens=on_tokens)
            except ValueError as exc:  # prompt too long for the context
                raise ApiError(400, str(exc)) from exc
        return result.token_ids, result.finish_reason


class Handler(BaseHTTPRequestHandler):
    service: Service  # set on the subclass built by `serve`
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok"})
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
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client left mid-stream; the engine call has already released its blocks

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
        prompt_ids = service.prompt_ids(body, chat)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.get("stream"):
            self._stream(request_id, prompt_ids, params, chat)
            return
        token_ids, reason = service.run(prompt_ids, params, lambda ids: None)
        text = service.tokenizer.decode(token_ids)
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        self._json(200, self._envelope(request_id, chat, [choice], prompt_ids, token_ids))

    def _envelope(
        self,
        request_id: str,
        chat: bool,
        choices: list[dict[str, Any]],
        prompt_ids: list[int],
        token_ids: list[int] | None,
    ) -> dict[str, Any]:
        kind = "chat.completion" if chat else "text_completion"
        out: dict[str, Any] = {
            "id": request_id,
            "object": kind,
            "created": int(time.time()),
            "model": self.service.model_name,
            "choices": choices,
        }
        if token_ids is not None:
            out["usage"] = {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(token_ids),
                "total_tokens": len(prompt_ids) + len(token_ids),
            }
        return out

    def _stream(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, chat: bool
    ) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        tokenizer = self.service.tokenizer
        token_ids: list[int] = []
        sent = 0

        def emit(delta: str, reason: str | None) -> None:
            if chat:
                message = (
                    {"role": "assistant", "content": delta} if not sent else {"content": delta}
                )
                choice = {"index": 0, "delta": message, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta, "finish_reason": reason}
            event = self._envelope(request_id, chat, [choice], prompt_ids, None)
            event["object"] = "chat.completion.chunk" if chat else "text_completion"
            self._event(json.dumps(event))

        def on_tokens(ids: list[int]) -> None:
            # Decode the whole completion and send what is new, holding back a partial
            # multi-byte character (it decodes to U+FFFD until its last byte arrives).
            nonlocal sent
            token_ids.extend(ids)
            text = tokenizer.decode(token_ids)
            if not text.endswith("\ufffd") and len(text) > sent:
                emit(text[sent:], None)
                sent = len(text)

        _, reason = self.service.run(prompt_ids, params, on_tokens)
        emit(tokenizer.decode(token_ids)[sent:], reason)
        self._event("[DONE]")

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


def serve(
    engine: SequentialEngine, tokenizer: Tokenizer, model_name: str, host: str, port: int
) -> None:
    handler = type("BoundHandler", (Handler,), {"service": Service(engine, tokenizer, model_name)})
    server = ThreadingHTTPServer((host, port), handler)
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
