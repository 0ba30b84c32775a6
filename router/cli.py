"""The `outrider` command: `generate` (one prompt, in-process), `serve` (HTTP API) and `k8s`
(a deployment on Kubernetes)."""

# At the top of the layers (docs/architecture.md): it wires the engine (workers/), the Ray
# runtime (cluster/) and the router together.
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from cluster import k8s, logs
from cluster.config import ConfigError, DeploymentConfig, load_config
from cluster.runtime import Runtime
from router.cli_args import build_parser
from router.routing import RoutingPolicy
from workers.engine.config import (
    RequestSpec,
)
from workers.engine.factory import LoadedEngine, build_engine
from workers.engine.heap import freeze_startup_heap
from workers.engine.llm_engine import LLMEngine
from workers.engine.logprobs import TokenLogprob
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import Kind, StructuredOutput, compile_grammar
from workers.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from router.server import Router

T = TypeVar("T")


def load(
    args: argparse.Namespace, config: DeploymentConfig | None = None, progress: bool = True
) -> LoadedEngine:
    """The in-process engine the flags (over the config `deployment_of` makes) ask for."""
    config = config or deployment_of(args)
    device = args.device or "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch sees no CUDA device")
    model = config.model_spec(device)
    return build_engine(model, config.engine_config(), progress=progress)


def _uses_cluster(args: argparse.Namespace) -> bool:
    return bool(args.cluster or args.config or args.address or args.prefill) or args.tp is not None


# An engine in this process (no --cluster, hence no config file) runs without speculation
# unless the flags say otherwise; all else (bfloat16, a GGUF file's quantized blocks on CPUs)
# defaults as a deployment does.
IN_PROCESS_DEFAULTS = {"speculative.method": "none"}


def deployment_of(args: argparse.Namespace) -> DeploymentConfig:
    """The config file (or the defaults) with the flags given on the command line over it: the
    one place flags become settings, for an engine in this process and for the pools' actors
    alike (`DeploymentConfig.engine_config`)."""
    if args.device is not None and _uses_cluster(args):
        raise ValueError(
            "--device is for an in-process engine; a cluster's actors run on the GPUs their "
            "pools ask for (pools.<pool>.resources.gpus)"
        )
    config = load_config(args.config)
    if not _uses_cluster(args):
        config = config.with_overrides(IN_PROCESS_DEFAULTS)
    method = args.spec_method
    overrides: dict[str, object] = {
        "model": args.model,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "engine.max_model_len": args.max_model_len,
        "engine.max_num_seqs": args.max_num_seqs,
        "engine.enforce_eager": True if args.enforce_eager else None,
        "engine.deterministic": True if args.deterministic else None,
        "engine.async_scheduling": True if args.async_scheduling else None,
        "engine.max_step_share": args.max_step_share,
        "engine.max_num_batched_tokens": args.max_num_batched_tokens,
        "speculative.method": method,
        "speculative.num_speculative_tokens": args.num_spec_tokens,
        "speculative.adaptive": False if args.no_adaptive else None,
        "speculative.eagle_prompt_lookup": False if args.no_eagle_lookup else None,
        "speculative.ngram_min": args.ngram_min,
        "speculative.ngram_max": args.ngram_max,
        "speculative.ngram_fallback_tokens": args.ngram_fallback_tokens,
        "speculative.min_draft_confidence": args.min_draft_confidence,
        "speculative.tree_nodes": args.draft_tree_nodes,
        "pools.drafter.replicas": args.drafters,
        "pools.drafter.draft_model": args.draft_model,
        "pools.drafter.draft_layers": args.draft_layers,
        "pools.drafter.eagle_head": args.eagle_head,
        "pools.verifier.tensor_parallel_size": args.tp,
        "ray.address": args.address,
        "router.log_format": getattr(args, "log_format", None),  # `serve`'s flag
    }
    threads = getattr(args, "threads", None)
    if _uses_cluster(args) and args.config is None and args.address is None and not args.tp:
        # A cluster of this host alone (what `make serve` starts): the verifier's torch threads
        # are --threads, or the host's cores, as an in-process engine's are; the drafter and
        # prefill workers share them (one CPU each).
        overrides["pools.verifier.resources.cpus"] = threads or os.cpu_count() or 1
    elif _uses_cluster(args) and threads:
        raise ValueError(
            "--threads is for an engine on this host (in-process, or a cluster of this host "
            "alone); a deployment's verifiers take the CPUs their pool asks for "
            "(pools.verifier.resources.cpus)"
        )
    if args.prefill == "remote":
        overrides["pools.prefill.replicas"] = max(1, config.pools.prefill.replicas)
        overrides["pools.prefill.min_remote_prompt_tokens"] = 1
    elif args.prefill == "local":
        overrides["pools.prefill.replicas"] = 0
    if method is not None and method not in ("none", "ngram", "suffix"):
        overrides["pools.drafter.method"] = method  # model-free methods run in the verifier
    return config.with_overrides(overrides)


def _start_runtime(
    args: argparse.Namespace, config: DeploymentConfig | None = None
) -> tuple[Runtime, Tokenizer, str]:
    from workers.model.loader import BUNDLED_MODEL_NAME, load_tokenizer

    config = config or deployment_of(args)
    runtime = Runtime.start(config)
    tokenizer = load_tokenizer(config.model)
    return runtime, tokenizer, config.model or BUNDLED_MODEL_NAME


def _local_outputs(
    engine: LLMEngine, prompt_ids: list[int], params: SamplingParams
) -> Iterator[RequestOutput]:
    engine.add_request("cli", prompt_ids, params, RequestSpec())
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"generation failed: {out.error}")
            yield out


def _structured(args: argparse.Namespace) -> StructuredOutput | None:
    """The grammar `generate` was asked to hold the answer to (ValueError when it is bad)."""
    asked: tuple[tuple[Kind, Any], ...] = (
        ("json", args.json_schema),
        ("regex", args.regex),
        ("choice", args.choice),
        ("grammar", args.grammar),
    )
    for kind, value in asked:
        if value is not None:
            return compile_grammar(kind, value)
    return None


def _generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=tuple(args.stop),
        logprobs=args.logprobs,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        structured=_structured(args),
    )
    runtime: Runtime | None = None
    if _uses_cluster(args):
        runtime, tok, _ = _start_runtime(args)
    else:
        loaded = load(args)
        tok = loaded.tokenizer
    try:
        text = (
            tok.apply_chat_template([{"role": "user", "content": args.prompt}])
            if args.chat
            else args.prompt
        )
        prompt_ids = tok.encode(text)
        start = time.perf_counter()
        stream = None if runtime is None else runtime.submit(prompt_ids, params)
        outputs = (
            _local_outputs(loaded.engine, prompt_ids, params)
            if stream is None
            else stream.outputs()
        )
        token_ids: list[int] = []
        pieces: list[str] = []
        logprobs: list[TokenLogprob] = []
        for out in outputs:
            token_ids += out.new_token_ids
            logprobs += out.logprobs
            pieces.append(out.text)
            if not args.json:
                sys.stdout.write(out.text)
                sys.stdout.flush()
            if out.finished:
                final = out
        elapsed = time.perf_counter() - start
    finally:
        if runtime is not None:
            runtime.shutdown()
    tokens_per_s = len(token_ids) / elapsed if elapsed > 0 else 0.0
    if args.json:
        result: dict[str, object] = {
            "text": "".join(pieces),
            "prompt_token_ids": prompt_ids,
            "token_ids": token_ids,
            "finish_reason": final.finish_reason,
            "tokens_per_s": round(tokens_per_s, 2),
            "spec": final.spec.as_dict(),
        }
        if params.logprobs is not None:
            result["logprobs"] = [
                {"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                for lp in logprobs
            ]
        if stream is not None:
            result["served_by"] = asdict(stream.served_by) if stream.served_by else None
        print(json.dumps(result))
    else:
        served = "" if stream is None else f", served by {stream.served_by}"
        print(
            f"\n[{len(token_ids)} tokens, {tokens_per_s:.1f} tokens/s, "
            f"finish: {final.finish_reason}, "
            f"mean acceptance length {final.spec.mean_acceptance_length:.2f}{served}]",
            file=sys.stderr,
        )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from cluster.ngram_pool import PoolFollower, follow
    from router.backends import Backend, LocalBackend, RuntimeBackend
    from router.keys import KeyLimits, read_keys_file
    from router.protocol import RequestBuilder
    from router.redis_server import EmbeddedRedis
    from router.server import Router, RouterOptions, run_router
    from workers.engine.engine_loop import EngineLoop

    config = deployment_of(args)
    logs.configure(config.router.log_format)  # the actors read the same setting
    if args.api_keys_file:
        read_keys_file(args.api_keys_file)  # a bad file stops the start, naming its line
    embedded: EmbeddedRedis | None = None
    if args.redis_url is None and config.redis.url is None:
        embedded = EmbeddedRedis().start()
        print(f"Redis: embedded redis-server on {embedded.url}", flush=True)
    # Verifiers follow the shared n-gram pool in the same Redis as the router.
    config = config.with_overrides({"redis.url": args.redis_url or (embedded and embedded.url)})
    redis_url = config.redis.connection_url()
    assert redis_url is not None
    backend: Backend
    follower: PoolFollower | None = None
    if _uses_cluster(args):
        runtime, tokenizer, name = _start_runtime(args, config)
        backend = RuntimeBackend(runtime, answer_within_s=config.router.deadlines.answer_within_s)
        info = runtime.actor_info()
        # A verifier's info names the other ranks of its group.
        names = [
            n for pool in info.values() for a in pool for n in [a["name"], *a.get("ranks", [])]
        ]
        print(f"Ray runtime up: {', '.join(names)}", flush=True)
        if runtime.owns_ray:
            ray_cfg = runtime.config.ray
            print(
                f"Ray dashboard: http://{ray_cfg.dashboard_host}:{ray_cfg.dashboard_port} "
                "(token authentication: the token is in ~/.ray/auth_token)",
                flush=True,
            )
            print(f"Engine metrics (Prometheus): {runtime.metrics_url()}", flush=True)
        block_size, max_model_len = config.engine.block_size, config.engine.max_model_len
    else:
        loaded = load(args, config)
        freeze_startup_heap()  # a server lives long: no full collection walks start-up's heap
        backend = LocalBackend(EngineLoop(loaded.engine))
        follower = follow(loaded.engine.speculator.drafters, redis_url, config.redis.password())
        tokenizer, name = loaded.tokenizer, loaded.model_name
        block_size = loaded.engine.config.block_size
        max_model_len = loaded.engine.config.max_model_len
    configured = args.config is not None
    router = config.router
    host = args.host or (router.host if configured else "127.0.0.1")
    options = RouterOptions(
        host=host,
        port=_given(args.port, router.port),
        grpc_port=None if args.no_grpc else _given(args.grpc_port, router.grpc_port),
        redis_url=redis_url,
        redis_password=config.redis.password(),
        max_queue=args.max_queue or router.max_queue,
        block_size=block_size,
        key_limits=KeyLimits(
            requests_per_s=router.requests_per_s,
            burst=router.burst,
            max_concurrent=router.max_concurrent_per_key,
            tokens_per_s=router.tokens_per_s,
            token_burst=router.token_burst,
        ),
        api_keys_file=args.api_keys_file,
        tls_cert_file=args.tls_cert_file or router.tls.cert_file,
        tls_key_file=args.tls_key_file or router.tls.key_file,
        docs=router.docs,
        migration=router.migration,
        policy=RoutingPolicy(hints_within_s=router.deadlines.hints_within_s),
        shutdown_grace_s=_given(args.shutdown_grace_s, router.shutdown_grace_s),
    )
    announce = partial(_banner, name, bool(args.api_keys_file))
    server = Router(backend, RequestBuilder(tokenizer, name, max_model_len), options, announce)
    # SIGTERM (Kubernetes stopping the pod) as Ctrl-C: the first drains the router; a second
    # stops it, and uvicorn then raises the signal again, which must reach the clean-up below
    # rather than end the process.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        run_router(server.serve())
    except KeyboardInterrupt:
        pass
    finally:
        asyncio.run(backend.close())
        if follower is not None:
            follower.stop()  # before Redis goes
        if embedded is not None:
            embedded.stop()
    return 0


def _given(value: T | None, default: T) -> T:
    """A flag's value when given, 0 among them (a port 0: one the OS chooses; no grace), else
    the configuration's."""
    return default if value is None else value


def _banner(name: str, keyed: bool, router: Router) -> None:
    """Where to send requests, printed once the router listens (the ports it bound)."""
    options = router.options
    scheme = "https" if options.tls_cert_file else "http"
    host, port = options.host, router.port
    print(f"Outrider is serving {name} on {scheme}://{host}:{port} (OpenAI API)", flush=True)
    if router.grpc_port is not None:
        print(f"  gRPC outrider.v1.Generation on {host}:{router.grpc_port}", flush=True)
    auth = " -H 'Authorization: Bearer <key>'" if keyed else ""
    print(
        f"  try: curl {scheme}://{host}:{port}/v1/completions -H 'Content-Type: application/json'"
        f"{auth} "
        '-d \'{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}\'',
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "k8s":
            return k8s.run(args)
        return _serve(args)
    except (ValueError, FileNotFoundError, k8s.K8sError, ConfigError) as exc:
        print(f"outrider: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
