"""The OpenAI-compatible HTTP API (FastAPI): completions and chat completions, streaming (SSE)
or not, models, health, readiness, Prometheus metrics, and the request registry.

Every error, including FastAPI's own (unknown route, wrong method), is an OpenAI error object
with its status. Bodies are parsed here rather than by FastAPI so that invalid UTF-8, invalid
JSON and wrong types all get a 400 naming the problem; the OpenAPI document still shows the
request schemas.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException

from router import errors
from router.backends import Step
from router.errors import RouterError
from router.logprobs import LogprobFormatter
from router.protocol import GenerateRequest
from router.responses import (
    ResponseBuilder,
    ResponsesRequest,
    chat_request,
    in_our_terms,
    stored_items,
)
from router.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_json,
    validate,
)
from router.service import REQUEST_API, Choice, RouterService, usage
from router.tools import ToolCallParser, finish_reason, read_answer
from workers.engine.logprobs import TokenLogprob

log = logging.getLogger(__name__)

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


def _error(exc: RouterError) -> JSONResponse:
    return JSONResponse(exc.body(), exc.status, headers=exc.headers())


def create_app(service: RouterService) -> FastAPI:
    app = FastAPI(
        title="Outrider",
        version="0.1.0",
        summary="OpenAI-compatible API of a disaggregated speculative-decoding server",
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
        """Redis and every verifier group answer, and the replica is not shutting down."""
        if service.draining:
            return _error(errors.overloaded("this replica is shutting down"))
        if await service.ready():
            return JSONResponse({"status": "ready"})
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
        body = validate(TokenizeRequest, parse_json(await request.body()))
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
        body = validate(DetokenizeRequest, parse_json(await request.body()))
        return {"prompt": service.builder.detokenize(body)}

    @app.get("/v1/requests/{request_id}", tags=["outrider"])
    async def request_status(request_id: str, request: Request) -> dict[str, Any]:
        """A request's registry entry (any replica can answer): its verifier group, state and
        committed token ids."""
        await service.authorize(_bearer(request))
        record = await service.state.lookup_request(request_id)
        if record is None:
            raise errors.not_found(f"no request {request_id!r}")
        return {"id": request_id, **record}

    @app.post("/v1/requests/{request_id}/resume", tags=["outrider"])
    async def resume(request_id: str, request: Request) -> Response:
        """Finish a request another replica started (its replica died, or its client left):
        the answer, in the original API's format, carries the whole text: the tokens already
        committed, then the rest. Body (optional): `{"stream": true}`."""
        await service.authorize(_bearer(request))
        raw = await request.body()
        body = parse_json(raw) if raw.strip() else {}
        stream = body.get("stream", False) if isinstance(body, dict) else None
        if not isinstance(stream, bool):
            raise errors.bad_request('body must be {"stream": <bool>} or empty', "stream")
        generate, committed = await service.resume(request_id, stream)
        prefix = service.builder.tokenizer.decode(committed)
        resumed = {"from": request_id, "committed_tokens": len(committed)}
        return await _serve(request, [generate], prefix, resumed)

    @app.post("/v1/completions", tags=["openai"], openapi_extra=_body_schema("CompletionRequest"))
    async def completions(request: Request) -> Response:
        await service.authorize(_bearer(request))
        body = validate(CompletionRequest, parse_json(await request.body()))
        return await _serve(request, service.builder.completions(body))

    @app.post(
        "/v1/chat/completions",
        tags=["openai"],
        openapi_extra=_body_schema("ChatCompletionRequest"),
    )
    async def chat_completions(request: Request) -> Response:
        await service.authorize(_bearer(request))
        body = validate(ChatCompletionRequest, parse_json(await request.body()))
        return await _serve(request, [service.builder.chat(body)])

    @app.post("/v1/responses", tags=["openai"], openapi_extra=_body_schema("ResponsesRequest"))
    async def create_response(request: Request) -> Response:
        """OpenAI's Responses API, served as a chat completion (router/responses.py)."""
        await service.authorize(_bearer(request))
        body = validate(ResponsesRequest, parse_json(await request.body()))
        earlier: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            earlier = (await _stored(body.previous_response_id, "previous_response_id"))["items"]
        try:
            chat, own = chat_request(body, earlier)
            generate = service.builder.chat(chat)
        except RouterError as exc:
            raise in_our_terms(exc) from None
        response_id = f"resp_{uuid.uuid4().hex}"
        REQUEST_API.set("responses")
        builder = ResponseBuilder(body, response_id, service.model_name, generate.tools)
        choices = await service.start([generate], response_id)
        steps = _merged(choices)
        items = [*earlier, *own]
        headers = {"X-Request-Id": response_id}
        if body.stream:
            events = _response_events(service, builder, generate, steps, items)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        last = choices[0][0]
        async for _, step in steps:
            builder.step(step.text, step.finished)
            last = step
            if await request.is_disconnected():
                await steps.aclose()
                return Response(status_code=499)
        builder.finish(last.finish_reason, usage([generate], [last]))
        await _store(service, builder.response, items)
        service.metrics.requests.labels("responses", "ok").inc()
        return JSONResponse(builder.response, headers=headers)

    async def _stored(response_id: str, param: str | None = None) -> dict[str, Any]:
        try:
            record = await service.state.load_response(response_id)
        except RedisError as exc:
            raise errors.shared_state_down(exc) from exc
        if record is None:
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
        try:
            deleted = await service.state.delete_response(response_id)
        except RedisError as exc:
            raise errors.shared_state_down(exc) from exc
        if not deleted:
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
        REQUEST_API.set(_api(generate))
        try:
            choices = await service.start(generates, request_id)  # refusals surface here
        except RouterError as exc:
            if resumed is not None:  # the error handler counts the others
                service.refused(_api(generate), exc)
            raise
        headers = {"X-Request-Id": request_id}
        steps = _merged(choices, prefix)
        if generate.stream:
            scored = [first.prompt_logprobs for first, _ in choices]
            events = _events(
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
        service.metrics.requests.labels(_api(generate), "ok").inc()
        answers = [
            _choice(formatter, g, index, first.prompt_logprobs, text, lps, step, prefix)
            for index, (g, (first, _), text, lps, step) in enumerate(
                zip(per_choice, choices, texts, logprobs, last, strict=True)
            )
        ]
        envelope = _envelope(service, request_id, generate.chat, answers)
        if generate.chat and generate.params.prompt_logprobs is not None:
            envelope["prompt_logprobs"] = formatter.prompt(choices[0][0].prompt_logprobs or [])
        envelope["usage"] = usage(generates, last)
        if resumed is not None:
            envelope["resumed"] = resumed
        return JSONResponse(envelope, headers=headers)

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


def _choice(
    formatter: LogprobFormatter,
    generate: GenerateRequest,
    index: int,
    prompt_logprobs: list[TokenLogprob] | None,
    texts: list[str],
    logprobs: list[TokenLogprob],
    last: Step,
    prefix: str,
) -> dict[str, Any]:
    """One choice of a whole (not streamed) answer. With `echo` the prompt comes first (its
    tokens' log-probabilities too); a request that only scores its prompt (`max_tokens` 0)
    shows none of the token the engine generated."""
    text = "" if generate.score_only else "".join(texts)
    logprobs = [] if generate.score_only else logprobs
    choice: dict[str, Any] = {"index": index, "finish_reason": last.finish_reason}
    wanted = generate.params.logprobs is not None
    if generate.chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if generate.tools is not None:
            message["content"], message["tool_calls"] = read_answer(generate.tools, text)
            calls = len(message["tool_calls"])
            choice["finish_reason"] = finish_reason(generate.tools, last.finish_reason, calls)
        choice["message"] = message
        choice["logprobs"] = formatter.chat(logprobs) if wanted else None
        return choice
    choice["text"] = (generate.echo or "") + text
    choice["logprobs"] = None
    if wanted and generate.echo is not None:
        entries = [*(prompt_logprobs or []), *logprobs]
        first = generate.prompt_ids[0]
        choice["logprobs"] = formatter.completion(entries, 0, first_token=first)[0]
    elif wanted:  # a resumed request's log-probabilities start at the tokens generated now
        choice["logprobs"] = formatter.completion(logprobs, len(prefix))[0]
    if generate.params.prompt_logprobs is not None:
        choice["prompt_logprobs"] = formatter.prompt(prompt_logprobs or [])
    return choice


_GENERATION_PATHS = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
}


def _api(generate: GenerateRequest) -> str:
    return "chat" if generate.chat else "completions"


def _envelope(
    service: RouterService, request_id: str, chat: bool, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": service.model_name,
        "choices": choices,
    }


async def _merged(
    choices: list[Choice], prefix: str = ""
) -> AsyncGenerator[tuple[int, Step], None]:
    """The choices' steps as they come, each with its choice's index. `prefix`, a resumed
    request's committed text (one choice), comes as a step of its own before the first.
    Closing it aborts every choice that has not finished."""
    if len(choices) == 1:
        first, rest = choices[0]
        try:
            if prefix:
                committed = replace(first, new_token_ids=[], logprobs=[], text=prefix)
                yield 0, replace(committed, finished=False, finish_reason=None)
            yield 0, first
            async for step in rest:
                yield 0, step
        finally:
            await rest.aclose()
        return
    queue: asyncio.Queue[tuple[int, Step | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, first: Step, rest: AsyncGenerator[Step, None]) -> None:
        try:
            await queue.put((index, first))
            async for step in rest:
                await queue.put((index, step))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, *choice)) for i, choice in enumerate(choices)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, rest in choices:  # aborts each unfinished choice in its verifier
            await rest.aclose()


async def _events(
    service: RouterService,
    formatter: LogprobFormatter,
    generates: list[GenerateRequest],
    per_choice: list[GenerateRequest],
    request_id: str,
    steps: AsyncGenerator[tuple[int, Step], None],
    scored: list[list[TokenLogprob] | None],
    prefix: str = "",
) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's chunk format, one choice's step a chunk, after an
    opening chunk per choice: chat's role, or an echoed prompt and the prompt's log-probabilities
    (`scored`, each choice's). Cancelled when the client disconnects, which closes `steps` and so
    aborts the choices in their verifier."""
    generate = generates[0]
    chat, n = generate.chat, len(scored)
    kind = "chat.completion.chunk" if chat else "text_completion"
    wanted = generate.params.logprobs is not None
    prompt_wanted = generate.params.prompt_logprobs is not None

    last: list[Step | None] = [None] * n

    def chunk(choices: list[dict[str, Any]], **fields: Any) -> bytes:
        event = _envelope(service, request_id, chat, choices)
        event["object"] = kind
        event.update(fields)
        if generate.include_usage:  # vLLM's continuous_usage_stats: the usage so far
            event["usage"] = usage(generates, last) if generate.continuous_usage else None
        return f"data: {json.dumps(event)}\n\n".encode()

    # Where each choice's next token's text starts in its text (completions); a resumed
    # request's log-probabilities start after the text committed before it.
    offsets = [len(prefix)] + [0] * (n - 1)
    for index, prompt_logprobs in enumerate(scored):
        if chat:
            role = {"role": "assistant", "content": ""}
            fields = {}
            if prompt_wanted and index == 0:
                fields["prompt_logprobs"] = formatter.prompt(prompt_logprobs or [])
            yield chunk([{"index": index, "delta": role, "finish_reason": None}], **fields)
        elif generate.echo is not None or prompt_wanted:
            echo = per_choice[index].echo
            opening: dict[str, Any] = {"index": index, "text": echo or ""}
            opening["logprobs"] = None
            if wanted and echo is not None:
                first = per_choice[index].prompt_ids[0]
                opening["logprobs"], offsets[index] = formatter.completion(
                    prompt_logprobs or [], 0, first_token=first
                )
            if prompt_wanted:
                opening["prompt_logprobs"] = formatter.prompt(prompt_logprobs or [])
            yield chunk([{**opening, "finish_reason": None}])
    parsers = [None if g.tools is None else ToolCallParser(g.tools) for g in per_choice]
    try:
        async for index, step in steps:
            last[index] = step
            if generate.score_only:  # only the end of each choice: its token is not shown
                if step.finished:
                    choice = {"index": index, "text": "", "logprobs": None}
                    yield chunk([{**choice, "finish_reason": step.finish_reason}])
                continue
            if not step.text and not step.finished and not step.logprobs:
                continue
            logprobs: dict[str, Any] | None = None
            finish = step.finish_reason
            if chat:
                if wanted:
                    logprobs = formatter.chat(step.logprobs)
                delta: dict[str, Any] = {}
                parser = parsers[index]
                if parser is None:
                    delta = {"content": step.text} if step.text else {}
                else:  # tool calls: the content outside blocks, and the calls' deltas
                    text, calls = _parsed(parser, step)
                    if not text and not calls and not step.finished and not step.logprobs:
                        continue
                    delta = {"content": text} if text else {}
                    if calls:
                        delta["tool_calls"] = calls
                    finish = finish_reason(parser.calling, finish, parser.num_calls)
                choice = {"index": index, "delta": delta, "logprobs": logprobs}
            else:
                if wanted:
                    logprobs, offsets[index] = formatter.completion(step.logprobs, offsets[index])
                choice = {"index": index, "text": step.text, "logprobs": logprobs}
            choice["finish_reason"] = finish
            yield chunk([choice])
    except RouterError as exc:  # failed after the 200 went out: say so in the stream
        service.metrics.requests.labels(_api(generate), "failed").inc()
        yield f"data: {json.dumps(exc.body())}\n\n".encode()
        yield b"data: [DONE]\n\n"
        return
    finally:
        await steps.aclose()
    service.metrics.requests.labels(_api(generate), "ok").inc()
    if generate.include_usage:
        final = _envelope(service, request_id, chat, [])
        final["object"] = kind
        final["usage"] = usage(generates, last)
        yield f"data: {json.dumps(final)}\n\n".encode()
    yield b"data: [DONE]\n\n"


async def _response_events(
    service: RouterService,
    builder: ResponseBuilder,
    generate: GenerateRequest,
    steps: AsyncGenerator[tuple[int, Step], None],
    items: list[dict[str, Any]],
) -> AsyncIterator[bytes]:
    """A Responses stream: the semantic events, each as an SSE event of its type (there is no
    `[DONE]`); the response is stored before its last event goes out."""

    def sse(event: dict[str, Any]) -> bytes:
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()

    for event in builder.start():
        yield sse(event)
    last: Step | None = None
    try:
        async for _, step in steps:
            last = step
            for event in builder.step(step.text, step.finished):
                yield sse(event)
    except RouterError as exc:  # failed after the 200 went out: say so in the stream
        service.metrics.requests.labels("responses", "failed").inc()
        yield sse(builder.failed(exc))
        return
    finally:
        await steps.aclose()
    assert last is not None
    ending = builder.finish(last.finish_reason, usage([generate], [last]))
    await _store(service, builder.response, items)
    service.metrics.requests.labels("responses", "ok").inc()
    for event in ending:
        yield sse(event)


async def _store(
    service: RouterService, response: dict[str, Any], items: list[dict[str, Any]]
) -> None:
    """Keep a finished response (with `store`) for GET and `previous_response_id`; bookkeeping
    that fails is logged, never the request's failure."""
    if not response["store"]:
        return
    record = {"response": response, "items": stored_items(items, response)}
    try:
        await service.state.save_response(response["id"], record)
    except RedisError as exc:
        log.warning("response %s not stored: %r", response["id"], exc)


def _parsed(parser: ToolCallParser, step: Step) -> tuple[str, list[dict[str, Any]]]:
    """A step's content and tool-call deltas, and at the answer's end what is left."""
    text, calls = parser.feed(step.text)
    if step.finished:
        rest, more = parser.finish()
        text, calls = text + rest, calls + more
    return text, calls
