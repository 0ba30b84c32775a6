"""The `outrider` command's arguments: its subcommands, their flags and the engine defaults a
flag left unset takes (what each command does is router/cli.py)."""

from __future__ import annotations

import argparse
import os

from cluster import k8s
from workers.engine.config import (
    DEFAULT_MIN_DRAFT_CONFIDENCE,
    METHODS_HELP,
    valid_method,
)
from workers.model.config import QUANTIZATIONS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled)")
    # Engine flags default to None: only the flags given apply, over a --config file or the
    # defaults (router/cli.py `deployment_of`).
    model.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="activations and float weights (default bfloat16; float32 for exactness tests)",
    )
    model.add_argument(
        "--quantization",
        default=None,
        choices=list(QUANTIZATIONS),
        help="how projection weights are held: auto (default: a GGUF file's blocks on CPUs), "
        "none (floats), gguf (the file's quantized blocks), int8 (quantized at load)",
    )
    model.add_argument(
        "--device",
        default=None,
        choices=["cpu", "cuda"],
        help="where an in-process engine runs (default cpu); --cluster places by pool GPUs",
    )
    model.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on a GPU, run every forward eagerly: no CUDA graphs captured at start-up",
    )
    model.add_argument(
        "--deterministic",
        action="store_true",
        help="on a GPU, batch-invariant kernels: a request's text never depends on the batch, "
        "the prefix cache or speculation (slower; the CPU's kernels are so always)",
    )
    model.add_argument(
        "--async-scheduling",
        action="store_true",
        help="launch each plain decode step before reading the last one's tokens, so that "
        "the host's work overlaps the GPU's (plain decoding at loads that do not speculate)",
    )
    model.add_argument(
        "--max-step-share",
        type=float,
        default=None,
        help="while several API keys have requests, the most of a step's places one key's may "
        "fill (default 0.5; 1: no cap)",
    )
    model.add_argument("--max-model-len", type=int, default=None, help="context (default 4096)")
    model.add_argument("--max-num-seqs", type=int, default=None, help="batch size (default 32)")
    model.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens a step may bring: prefill chunks, decode and draft tokens (default 512)",
    )
    model.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads of the engine (in-process, or the verifier's in a cluster of this "
        "host alone; default: the host's cores)",
    )
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--spec-method", default=None, type=_method, help=METHODS_HELP)
    spec.add_argument(
        "--num-spec-tokens", type=int, default=None, help="most draft tokens per step (default 4)"
    )
    spec.add_argument(
        "--draft-model",
        default=None,
        help="draft model (GGUF or HF folder), or a published EAGLE-3 head's folder",
    )
    spec.add_argument(
        "--draft-layers", type=int, default=None, help="use the target's first N layers as draft"
    )
    spec.add_argument(
        "--eagle-head",
        default=None,
        help="EAGLE-3 head for --spec-method eagle: our file or a published folder (the "
        "bundled model has one built in)",
    )
    spec.add_argument(
        "--ngram-min", type=int, default=None, help="shortest n-gram to match (default 2)"
    )
    spec.add_argument(
        "--ngram-max", type=int, default=None, help="longest n-gram to match (default 4)"
    )
    spec.add_argument(
        "--ngram-fallback-tokens",
        type=int,
        default=None,
        help="tokens ngram/suffix draft from a match of the last token alone (default 8; 0: off)",
    )
    spec.add_argument(
        "--min-draft-confidence",
        type=float,
        default=None,
        help="draft_model and eagle end a draft once their probability of it falls below "
        f"this (default {DEFAULT_MIN_DRAFT_CONFIDENCE}; 0: always k)",
    )
    spec.add_argument(
        "--draft-tree-nodes",
        type=int,
        default=None,
        help="EAGLE drafts trees of up to this many nodes where they pay more than a chain "
        "(default 0: chains only)",
    )
    spec.add_argument("--no-adaptive", action="store_true", help="always draft the full k")
    spec.add_argument(
        "--no-eagle-lookup",
        action="store_true",
        help="EAGLE drafts with its head only (default: prompt lookup first where text repeats)",
    )
    ray_group = parser.add_argument_group("disaggregated runtime (Ray)")
    ray_group.add_argument(
        "--cluster", action="store_true", help="run on the Ray runtime: verifier and drafter pools"
    )
    ray_group.add_argument(
        "--config", default=None, help="deployment config YAML (implies --cluster)"
    )
    ray_group.add_argument(
        "--address",
        default=None,
        help="join this Ray cluster instead of starting one (implies --cluster)",
    )
    ray_group.add_argument(
        "--drafters", type=int, default=None, help="drafter actors (default: the config's, 1)"
    )
    ray_group.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel ranks per verifier group (default: the config's, 1; implies "
        "--cluster)",
    )
    ray_group.add_argument(
        "--prefill",
        default=None,
        choices=["remote", "local"],
        help="remote: every prompt prefills on a prefill worker (at least one is started); "
        "local: the verifier prefills (no prefill pool); default: the config's (workers take "
        "prompts of pools.prefill.min_remote_prompt_tokens and more). Implies --cluster",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outrider",
        description="The `outrider` command: `generate` (one prompt, in-process), `serve` "
        "(HTTP API) and `k8s` (a deployment on Kubernetes).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from one prompt in-process")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="0 = off")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="0 = off")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    structured = gen.add_mutually_exclusive_group()
    structured.add_argument(
        "--json-schema", default=None, metavar="SCHEMA", help="the answer follows this JSON schema"
    )
    structured.add_argument("--regex", default=None, help="the whole answer matches this regex")
    structured.add_argument(
        "--choice", action="append", default=None, help="the answer is one of these (repeatable)"
    )
    structured.add_argument(
        "--grammar", default=None, help="the answer follows this Lark grammar (llguidance's)"
    )
    gen.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="with --json: each token's log-probability and the N likeliest at its position",
    )
    add_engine_args(gen)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API and gRPC")
    api = serve.add_argument_group("router")
    api.add_argument("--host", default=None, help="default 127.0.0.1 (the config's with --config)")
    api.add_argument(
        "--port", type=int, default=None, help="HTTP port (default 8000; 0: one the OS chooses)"
    )
    api.add_argument(
        "--grpc-port", type=int, default=None, help="gRPC port (default 50051; 0: the OS chooses)"
    )
    api.add_argument("--no-grpc", action="store_true", help="serve HTTP only")
    api.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="shared Redis (default $REDIS_URL, else the config's, else an embedded redis-server)",
    )
    api.add_argument(
        "--api-keys-file",
        default=os.environ.get("OUTRIDER_API_KEYS_FILE"),
        help="API keys, one per line: <key> [name] [requests/s] [burst] [option=value ...] "
        "(default $OUTRIDER_API_KEYS_FILE; none: the API is open); read again when it changes",
    )
    api.add_argument(
        "--tls-cert-file",
        default=os.environ.get("OUTRIDER_TLS_CERT_FILE"),
        help="PEM certificate (with --tls-key-file: HTTPS and gRPC over TLS only; "
        "default $OUTRIDER_TLS_CERT_FILE, else the config's router.tls)",
    )
    api.add_argument(
        "--tls-key-file",
        default=os.environ.get("OUTRIDER_TLS_KEY_FILE"),
        help="PEM private key of --tls-cert-file (default $OUTRIDER_TLS_KEY_FILE)",
    )
    api.add_argument("--max-queue", type=int, default=None, help="requests in flight before 503")
    api.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=None,
        help="on SIGTERM or Ctrl-C, how long requests in flight may finish (default 30)",
    )
    api.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=None,
        help="log lines (a line per finished request among them) as text or JSON "
        "(default: the config's router.log_format, text)",
    )
    add_engine_args(serve)

    k8s.add_parser(sub)
    return parser


def _method(value: str) -> str:
    if not valid_method(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not {METHODS_HELP}")
    return value
