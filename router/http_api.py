"""The OpenAI-compatible HTTP API (FastAPI): completions and chat completions, streaming (SSE)
or not, models, health, readiness, Prometheus metrics, and the request registry.

Every error, including FastAPI's own (unknown route, wrong method), is an OpenAI error object
with its status. Bodies are parsed here rather than by FastAPI so that invalid UTF-8, invalid
JSON and wrong types all get a 400 naming the problem; the OpenAPI document still shows the
request schemas. A body is read as it streams in and refused (413) once it passes
`MAX_BODY_BYTES`, so a huge one never sits in the router's memory. How each answer goes out
(choices, streamed events) is router/streaming.py.
"""

from __future__ import annotations

import importlib.metadata
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException

from router import errors
from router.errors import RouterError
from router.logprobs import LogprobFormatter
from router.protocol import GenerateRequest
from router.registry import is_outage
from router.responses import (
    ResponseBuilder,
    ResponsesRequest,
    chat_request,
    in_our_terms,
)
from router.schemas import (
    MAX_BODY_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_json,
    validate,
)
from router.service import REQUEST_API, RouterService
from router.streaming import (
    answer_choice,
    api_name,
    completion_events,
    envelope,
    merged,
    response_events,
    store_response,
)
from router.usage import usage
from workers.engine.logprobs import TokenLogprob

log = logging.getLogger(__name__)
MAX_DRAINED_BYTES = 16 << 20  # past this, a refused body is no longer read

try:
    _VERSION = importlib.metadata.version("outrider")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was not installed
    _VERSION = "unknown"


def _body_schema(name: str) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
        }
    }


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def _body(request: Request) -> bytes:
    """The request's body, refused (413) once it is known to pass `MAX_BODY_BYTES`. What comes
    past the limit is read and dropped, up to `MAX_DRAINED_BYTES` (so that a client still
    sending reads the 413 rather than a reset connection); a larger body is refused at once."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_DRAINED_BYTES:
        raise errors.too_large(f"request body over {MAX_BODY_BYTES} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_DRAINED_BYTES:
            break
        if size <= MAX_BODY_BYTES:
            chunks.append(chunk)
        elif chunks:
            chunks = []  # refused: the rest is only read
    if size > MAX_BODY_BYTES:
        raise errors.too_large(f"request body over {MAX_BODY_BYTES} bytes")
    return b"".join(chunks)


def _error(exc: RouterError) -> JSONResponse:
    return JSONResponse(exc.body(), exc.status, headers=exc.headers())


def create_app(service: RouterService, docs: bool = True) -> FastAPI:
    """The API over `service`; `docs`: serve the OpenAPI document and its pages (/docs,
    /redoc, /openapi.json)."""
    app = FastAPI(
        title="Outrider",
        version="0.1.0",
        summary="OpenAI-compatible API of a disaggregated speculative-decoding server",
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    # Log-probabilities naming tokens by their text, or by id (return_tokens_as_token_ids).
    formatters = {ids: LogprobFormatter(service.builder.tokenizer, ids) for ids in (False, True)}

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> JSONResponse:
        # A refused generation request counts whatever refused it (key, rate limit, body,
        # admission), as on gRPC. A resume is counted by `_serve`, which knows its API.
        if api := _GENERATION_PATHS.get(request.url.path):
            service.refused(api, exc)
        return _error(exc)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = RouterError(exc.status_code, str(exc.detail), kind, "INVALID_ARGUMENT")
        return _error(error)

    @app.exception_handler(RedisError)
    async def _redis_down(request: Request, exc: RedisError) -> JSONResponse:
        # What needs Redis itself (the registry, stored responses) while it is down: 503; a
        # command Redis refused fails this call alone.
        service.redis.failed(exc)
        if is_outage(exc):
            return await _router_error(request, errors.shared_state_down(exc))
        return await _router_error(request, errors.server_error("the shared state refused a call"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _error(errors.server_error(f"internal error: {type(exc).__name__}"))

    @app.get("/health", tags=["operations"])
    async def health() -> dict[str, str]:
        """The process is up."""
        return {"status": "ok"}

    @app.get("/ready", tags=["operations"], responses={503: {"description": "not ready"}})
    async def ready() -> Response:
        """Every verifier group answers, and Redis (or, without API keys, it may be down: the
        status says degraded), and the replica is not shutting down."""
        if service.draining:
            return _error(errors.overloaded("this replica is shutting down"))
        status = await service.ready()
        if status is not None:  # "degraded": Redis is down, requests are served without it
            return JSONResponse({"status": status, "redis": service.redis.up})
        return _error(errors.overloaded("the pools or Redis are not reachable"))

    @app.get("/metrics", tags=["operations"])
    async def metrics() -> Response:
        """Prometheus metrics of this replica."""
        await service.load()
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", tags=["vllm"])
    async def version() -> dict[str, str]:
        """The server's version."""
        return {"version": _VERSION}

    def model_card() -> dict[str, Any]:
        return {
            "id": service.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "outrider",
            "root": service.model_name,
            "max_model_len": service.builder.max_model_len,  # vLLM's extension
        }

    @app.get("/v1/models", tags=["openai"])
    async def models(request: Request) -> dict[str, Any]:
        await service.authorize(_bearer(request))
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", tags=["openai"])
    async def model(model: str, request: Request) -> dict[str, Any]:
        """The served model's card (OpenAI's retrieve); 404 for any other id."""
        await service.authorize(_bearer(request))
        service.builder.check_model(model)
        return model_card()

    @app.post("/tokenize", tags=["vllm"], openapi_extra=_body_schema("TokenizeRequest"))
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's: a prompt's (or a conversation's) token ids, as generation would see them."""
        await service.authorize(_bearer(request))
        return await service.offload(_tokenize, await _body(request))

    def _tokenize(raw: bytes) -> dict[str, Any]:
        body = validate(TokenizeRequest, parse_json(raw))
        tokens = service.builder.tokenize(body)
        tokenizer = service.builder.tokenizer
        strs = [tokenizer.token_text(t) for t in tokens] if body.return_token_strs else None
        return {
            "count": len(tokens),
            "max_model_len": service.builder.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }

    @app.post("/detokenize", tags=["vllm"], openapi_extra=_body_schema("DetokenizeRequest"))
    async def detokenize(request: Request) -> dict[str, str]:
        """vLLM's: the text of token ids."""
        await service.authorize(_bearer(request))
        body = validate(DetokenizeRequest, parse_json(await _body(request)))
        return {"prompt": await service.offload(service.builder.detokenize, body)}

    @app.get("/v1/requests/{request_id}", tags=["outrider"])
    async def request_status(request_id: str, request: Request) -> dict[str, Any]:
        """A request's registry entry (any replica can answer): its verifier group, state and
        committed token ids."""
        await service.authorize(_bearer(request))
        record = await service.lookup_request(request_id)  # another key's: 404
        return {"id": request_id, **{k: v for k, v in record.items() if k != "owner"}}

    @app.post("/v1/requests/{request_id}/resume", tags=["outrider"])
    async def resume(request_id: str, request: Request) -> Response:
        """Finish a request another replica started (its replica died, or its client left):
        the answer, in the original API's format, carries the whole text: the tokens already
        committed, then the rest. Body (optional): `{"stream": true}`."""
        await service.authorize(_bearer(request))
        raw = await _body(request)
        body = parse_json(raw) if raw.strip() else {}
        stream = body.get("stream", False) if isinstance(body, dict) else None
        if not isinstance(stream, bool):
            raise errors.bad_request('body must be {"stream": <bool>} or empty', "stream")
        generate, committed = await service.resume(request_id, stream)
        prefix = await service.offload(service.builder.tokenizer.decode, committed)
        resumed = {"from": request_id, "committed_tokens": len(committed)}
        return await _serve(request, [generate], prefix, resumed)

    @app.post("/v1/completions", tags=["openai"], openapi_extra=_body_schema("CompletionRequest"))
    async def completions(request: Request) -> Response:
        await service.authorize(_bearer(request))
        raw = await _body(request)
        return await _serve(request, await service.offload(_completions, raw))

    def _completions(raw: bytes) -> list[GenerateRequest]:
        return service.builder.completions(validate(CompletionRequest, parse_json(raw)))

    @app.post(
        "/v1/chat/completions",
        tags=["openai"],
        openapi_extra=_body_schema("ChatCompletionRequest"),
    )
    async def chat_completions(request: Request) -> Response:
        await service.authorize(_bearer(request))
        raw = await _body(request)
        return await _serve(request, [await service.offload(_chat, raw)])

    def _chat(raw: bytes) -> GenerateRequest:
        return service.builder.chat(validate(ChatCompletionRequest, parse_json(raw)))

    @app.post("/v1/responses", tags=["openai"], openapi_extra=_body_schema("ResponsesRequest"))
    async def create_response(request: Request) -> Response:
        """OpenAI's Responses API, served as a chat completion (router/responses.py)."""
        await service.authorize(_bearer(request))
        raw = await _body(request)
        body = await service.offload(_responses_body, raw)
        earlier: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            earlier = (await _stored(body.previous_response_id, "previous_response_id"))["items"]
        try:
            chat, own = chat_request(body, earlier)
            generate = await service.offload(service.builder.chat, chat)
        except RouterError as exc:
            raise in_our_terms(exc) from None
        response_id = f"resp_{uuid.uuid4().hex}"
        REQUEST_API.set("responses")
        builder = ResponseBuilder(body, response_id, service.model_name, generate.tools)
        choices = await service.start([generate], response_id)
        steps = merged(choices)
        items = [*earlier, *own]
        headers = {"X-Request-Id": response_id}
        if body.stream:
            events = response_events(service, builder, generate, steps, items)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        last = choices[0][0]
        async for _, step in steps:
            builder.step(step.text, step.finished)
            last = step
            if await request.is_disconnected():
                await steps.aclose()
                return Response(status_code=499)
        builder.finish(last.finish_reason, usage([generate], [last]))
        await store_response(service, builder.response, items)
        service.metrics.requests.labels("responses", "ok").inc()
        return JSONResponse(builder.response, headers=headers)

    def _responses_body(raw: bytes) -> ResponsesRequest:
        return validate(ResponsesRequest, parse_json(raw))

    async def _stored(response_id: str, param: str | None = None) -> dict[str, Any]:
        record = await service.state.load_response(response_id)  # Redis down: 503 (above)
        if record is None or record.get("owner", "") != service.owner():  # another key's: 404
            raise errors.not_found(f"no stored response {response_id!r}", param)
        return record

    @app.get("/v1/responses/{response_id}", tags=["openai"])
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        """A stored response (any replica answers)."""
        await service.authorize(_bearer(request))
        response: dict[str, Any] = (await _stored(response_id))["response"]
        return response

    @app.delete("/v1/responses/{response_id}", tags=["openai"])
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        await service.authorize(_bearer(request))
        await _stored(response_id)  # the caller's own, or 404
        if not await service.state.delete_response(response_id):
            raise errors.not_found(f"no stored response {response_id!r}")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def _serve(
        request: Request,
        generates: list[GenerateRequest],
        prefix: str = "",
        resumed: dict[str, Any] | None = None,
    ) -> Response:
        """Serve one request: its prompts (a batch of completions, else one), each with its
        choices; choice k of the answer is the k-th of them in order."""
        generate = generates[0]  # what they share: API, stream, options
        formatter = formatters[generate.tokens_as_ids]
        per_choice = [g for g in generates for _ in range(g.n)]
        request_id = f"{'chatcmpl' if generate.chat else 'cmpl'}-{uuid.uuid4().hex}"
        REQUEST_API.set(api_name(generate))
        try:
            choices = await service.start(generates, request_id)  # refusals surface here
        except RouterError as exc:
            if resumed is not None:  # the error handler counts the others
                service.refused(api_name(generate), exc)
            raise
        headers = {"X-Request-Id": request_id}
        steps = merged(choices, prefix)
        if generate.stream:
            scored = [first.prompt_logprobs for first, _ in choices]
            events = completion_events(
                service, formatter, generates, per_choice, request_id, steps, scored, prefix
            )
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        texts: list[list[str]] = [[] for _ in choices]
        logprobs: list[list[TokenLogprob]] = [[] for _ in choices]
        last = [first for first, _ in choices]
        async for index, step in steps:
            texts[index].append(step.text)
            logprobs[index] += step.logprobs
            last[index] = step
            if await request.is_disconnected():
                await steps.aclose()  # aborts the choices and frees their KV blocks
                return Response(status_code=499)
        service.metrics.requests.labels(api_name(generate), "ok").inc()
        answers = [
            answer_choice(formatter, g, index, first.prompt_logprobs, text, lps, step, prefix)
            for index, (g, (first, _), text, lps, step) in enumerate(
                zip(per_choice, choices, texts, logprobs, last, strict=True)
            )
        ]
        answer = envelope(service, request_id, generate.chat, answers)
        if generate.chat and generate.params.prompt_logprobs is not None:
            answer["prompt_logprobs"] = formatter.prompt(choices[0][0].prompt_logprobs or [])
        answer["usage"] = usage(generates, last)
        if resumed is not None:
            answer["resumed"] = resumed
        return JSONResponse(answer, headers=headers)

    def _openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (
                CompletionRequest,
                ChatCompletionRequest,
                TokenizeRequest,
                DetokenizeRequest,
                ResponsesRequest,
            ):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = _openapi  # type: ignore[method-assign]
    return app


_GENERATION_PATHS = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
}
