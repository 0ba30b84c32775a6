"""The gRPC API (grpc.aio): `outrider.v1.Generation/Generate`, server-streaming, plus the standard
`grpc.health.v1.Health` service.

A request is turned into the same body the HTTP API validates, so both APIs accept and refuse
exactly the same things; refusals map to gRPC status codes (see `router/errors.py`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from router import errors
from router.errors import RouterError
from router.proto import codegen
from router.protocol import GenerateRequest
from router.schemas import ChatCompletionRequest, CompletionRequest, validate
from router.service import REQUEST_API, RouterService
from workers.engine.logprobs import TokenLogprob
from workers.engine.sequence import SpecStats

codegen.ensure()

from router.proto import generate_pb2, generate_pb2_grpc  # noqa: E402

SERVICE_NAME = "outrider.v1.Generation"


def _body(request: Any) -> tuple[dict[str, Any], bool]:
    """The request as an OpenAI-style body, and whether it is a chat request."""
    body: dict[str, Any] = {"model": request.model or None}
    for name in (
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "truncate_prompt_tokens",
        "priority",
    ):
        if request.HasField(name):
            body[name] = getattr(request, name)
    for name in ("allowed_token_ids", "bad_words"):
        if getattr(request, name):
            body[name] = list(getattr(request, name))
    body["include_stop_str_in_output"] = request.include_stop_str_in_output
    if request.stop:
        body["stop"] = list(request.stop)
    body["ignore_eos"] = request.ignore_eos
    if request.user:
        body["user"] = request.user
    if request.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in request.logit_bias.items()}
    if request.stop_token_ids:
        body["stop_token_ids"] = list(request.stop_token_ids)
    if request.HasField("structured_output"):
        body["structured_outputs"] = _structured(request.structured_output)
    chat = request.WhichOneof("input") == "chat"
    if request.HasField("logprobs"):
        if chat:
            body["logprobs"], body["top_logprobs"] = True, request.logprobs
        else:
            body["logprobs"] = request.logprobs
    if request.HasField("speculative"):
        s = request.speculative
        spec: dict[str, Any] = {"enabled": not s.disabled}
        if s.HasField("method"):
            spec["method"] = s.method
        if s.HasField("num_speculative_tokens"):
            spec["num_speculative_tokens"] = s.num_speculative_tokens
        body["speculative"] = spec
    if chat:
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        return body, True
    if request.WhichOneof("input") == "prompt_token_ids":
        body["prompt"] = list(request.prompt_token_ids.ids)
    else:
        body["prompt"] = request.prompt
    return body, False


def _structured(message: Any) -> dict[str, Any]:
    """A `StructuredOutput` as the HTTP API's `structured_outputs` (with no kind: none)."""
    kind = message.WhichOneof("kind")
    if kind == "json_schema":
        return {"json": message.json_schema}
    if kind == "choice":
        return {"choice": list(message.choice.choices)}
    return {} if kind is None else {kind: getattr(message, kind)}


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, service: RouterService) -> None:
        self.service = service

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        scheme, _, token = str(metadata.get("authorization", "")).partition(" ")
        await self.service.authorize(token.strip() if scheme.lower() == "bearer" else None)

    async def ListModels(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            _check_decoded(request)
            await self._authorize(context)
        except RouterError as exc:
            await _abort(context, exc)
        return generate_pb2.ListModelsResponse(models=[self.service.model_name])

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        service = self.service
        request_id = f"grpc-{uuid.uuid4().hex}"
        REQUEST_API.set("grpc")
        try:
            _check_decoded(request)
            await self._authorize(context)
            body, chat = _body(request)
            generate = await service.offload(_build, service, body, chat)
            steps = service.generate(generate, request_id)
            async for step in steps:
                response = generate_pb2.GenerateResponse(
                    request_id=request_id,
                    token_ids=step.new_token_ids,
                    text=step.text,
                    finished=step.finished,
                    finish_reason=step.finish_reason or "",
                    logprobs=[_token_logprob(lp) for lp in step.logprobs],
                )
                if step.finished:
                    response.usage.CopyFrom(
                        generate_pb2.Usage(
                            prompt_tokens=len(generate.prompt_ids),
                            completion_tokens=step.num_output_tokens,
                            speculative=_spec_stats(step.spec),
                            cached_prompt_tokens=step.num_cached_tokens,
                        )
                    )
                yield response
        except RouterError as exc:
            service.refused("grpc", exc)
            await _abort(context, exc)
        service.metrics.requests.labels("grpc", "ok").inc()


def _build(service: RouterService, body: dict[str, Any], chat: bool) -> GenerateRequest:
    """The request in the engine's terms (on the router's work threads: it tokenizes)."""
    if chat:
        return service.builder.chat(validate(ChatCompletionRequest, body))
    return service.builder.completion(validate(CompletionRequest, body))


def _token_logprob(logprob: TokenLogprob) -> Any:
    top = [generate_pb2.TopLogprob(token_id=i, logprob=v) for i, v in logprob.top]
    return generate_pb2.TokenLogprob(token_id=logprob.token_id, logprob=logprob.logprob, top=top)


def _spec_stats(stats: SpecStats) -> Any:
    return generate_pb2.SpeculativeStats(
        drafted=stats.drafted,
        accepted=stats.accepted,
        verify_steps=stats.verify_steps,
        mean_acceptance_length=stats.mean_acceptance_length,
    )


async def _abort(context: grpc.aio.ServicerContext, exc: RouterError) -> None:
    if exc.retry_after_s is not None:
        context.set_trailing_metadata((("retry-after", exc.headers()["Retry-After"]),))
    await context.abort(getattr(grpc.StatusCode, exc.grpc_code), exc.message)


class _Undecodable:
    """Bytes that are not the method's request message (what `_lenient` decodes them to)."""

    def __init__(self, message: str, error: str) -> None:
        self.message, self.error = message, error


def _lenient(message: Any) -> Any:
    """A request deserializer that hands undecodable bytes to the method (as `_Undecodable`),
    which refuses them with INVALID_ARGUMENT; grpcio itself would answer UNKNOWN and log a
    traceback for each."""

    def decode(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except DecodeError as exc:
            return _Undecodable(message.DESCRIPTOR.full_name, str(exc))

    return decode


def _check_decoded(request: Any) -> None:
    if isinstance(request, _Undecodable):
        raise errors.bad_request(f"the request is not a valid {request.message}: {request.error}")


async def start_grpc(
    service: RouterService, host: str, port: int, credentials: Any = None
) -> tuple[Any, int]:
    """A started grpc.aio server with the Generation and Health services, and the port it
    listens on (port 0: the one the OS chose); over TLS only when given server `credentials`."""
    server = grpc.aio.server()
    servicer = GenerationServicer(service)
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_lenient(generate_pb2.GenerateRequest),
            response_serializer=generate_pb2.GenerateResponse.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels,
            request_deserializer=_lenient(generate_pb2.ListModelsRequest),
            response_serializer=generate_pb2.ListModelsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = f"{host}:{port}"
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"cannot bind the gRPC port {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
