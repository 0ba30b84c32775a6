"""Answers of the OpenAI endpoints as they go out: a whole answer's choices, the steps of
several choices merged as they come, and the server-sent events of a streamed completion, chat
completion or Responses request (their usage, errors after the stream began, and the stored
response)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any

from router.backends import Step
from router.errors import RouterError
from router.logprobs import LogprobFormatter
from router.protocol import GenerateRequest
from router.responses import (
    ResponseBuilder,
    stored_items,
)
from router.service import Choice, RouterService
from router.tools import ToolCallParser, finish_reason, read_answer
from router.usage import usage
from workers.engine.logprobs import TokenLogprob

log = logging.getLogger(__name__)


def answer_choice(
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


def envelope(
    service: RouterService, request_id: str, chat: bool, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": service.model_name,
        "choices": choices,
    }


async def merged(choices: list[Choice], prefix: str = "") -> AsyncGenerator[tuple[int, Step], None]:
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


async def completion_events(
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
        event = envelope(service, request_id, chat, choices)
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
                    text, calls = parsed_calls(parser, step)
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
        service.metrics.requests.labels(api_name(generate), "failed").inc()
        yield f"data: {json.dumps(exc.body())}\n\n".encode()
        yield b"data: [DONE]\n\n"
        return
    finally:
        await steps.aclose()
    service.metrics.requests.labels(api_name(generate), "ok").inc()
    if generate.include_usage:
        final = envelope(service, request_id, chat, [])
        final["object"] = kind
        final["usage"] = usage(generates, last)
        yield f"data: {json.dumps(final)}\n\n".encode()
    yield b"data: [DONE]\n\n"


async def response_events(
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
    await store_response(service, builder.response, items)
    service.metrics.requests.labels("responses", "ok").inc()
    for event in ending:
        yield sse(event)


async def store_response(
    service: RouterService, response: dict[str, Any], items: list[dict[str, Any]]
) -> None:
    """Keep a finished response (with `store`) for GET and `previous_response_id`; bookkeeping
    that fails is logged, never the request's failure."""
    if not response["store"]:
        return
    record = {
        "owner": service.owner(),  # only the key that made it reads, continues or deletes it
        "response": response,
        "items": stored_items(items, response),
    }
    # Not stored while Redis is down (the outage is logged once, by the watch).
    await service.redis.shared(lambda: service.state.save_response(response["id"], record))


def parsed_calls(parser: ToolCallParser, step: Step) -> tuple[str, list[dict[str, Any]]]:
    """A step's content and tool-call deltas, and at the answer's end what is left."""
    text, calls = parser.feed(step.text)
    if step.finished:
        rest, more = parser.finish()
        text, calls = text + rest, calls + more
    return text, calls


def api_name(generate: GenerateRequest) -> str:
    return "chat" if generate.chat else "completions"
