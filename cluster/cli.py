"""The `outrider` command: `generate` (one prompt, in-process), `serve` (HTTP API) and `k8s`
(a deployment on Kubernetes)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import torch

from cluster import k8s
from workers.engine.config import SPEC_METHODS, EngineConfig, RequestSpec, SpecConfig
from workers.engine.factory import LoadedEngine, ModelSpec, build_engine
from workers.engine.sampling_params import SamplingParams


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled)")
    model.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    model.add_argument("--max-model-len", type=int, default=4096, help="context length to serve")
    model.add_argument("--max-num-seqs", type=int, default=32, help="sequences batched at once")
    model.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--spec-method", default="none", choices=SPEC_METHODS)
    spec.add_argument("--num-spec-tokens", type=int, default=4, help="most draft tokens per step")
    spec.add_argument("--draft-model", default=None, help="draft model (GGUF or HF folder)")
    spec.add_argument(
        "--draft-layers", type=int, default=None, help="use the target's first N layers as draft"
    )
    spec.add_argument(
        "--eagle-head",
        default=None,
        help="EAGLE head file for --spec-method eagle (the bundled model has one built in)",
    )
    spec.add_argument("--ngram-min", type=int, default=2, help="shortest n-gram to match")
    spec.add_argument("--ngram-max", type=int, default=4, help="longest n-gram to match")
    spec.add_argument("--no-adaptive", action="store_true", help="always draft the full k")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="outrider", description=__doc__)
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
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    _add_engine_args(gen)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    _add_engine_args(serve)

    k8s.add_parser(sub)
    return parser


def load(args: argparse.Namespace, progress: bool = True) -> LoadedEngine:
    spec = SpecConfig(
        method=args.spec_method,
        num_speculative_tokens=args.num_spec_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        adaptive=not args.no_adaptive,
    )
    config = EngineConfig(
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, spec=spec
    )
    model = ModelSpec(args.model, args.dtype, args.draft_model, args.draft_layers, args.eagle_head)
    return build_engine(model, config, progress=progress)


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
    )
    loaded = load(args)
    tok, engine = loaded.tokenizer, loaded.engine
    text = (
        tok.apply_chat_template([{"role": "user", "content": args.prompt}])
        if args.chat
        else args.prompt
    )
    prompt_ids = tok.encode(text)
    engine.add_request("cli", prompt_ids, params, RequestSpec())
    token_ids: list[int] = []
    pieces: list[str] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            token_ids += out.new_token_ids
            pieces.append(out.text)
            if not args.json:
                sys.stdout.write(out.text)
                sys.stdout.flush()
            if out.finished:
                final = out
    elapsed = time.perf_counter() - start
    tokens_per_s = len(token_ids) / elapsed if elapsed > 0 else 0.0
    if args.json:
        result = {
            "text": "".join(pieces),
            "prompt_token_ids": prompt_ids,
            "token_ids": token_ids,
            "finish_reason": final.finish_reason,
            "tokens_per_s": round(tokens_per_s, 2),
            "spec": final.spec.as_dict(),
        }
        print(json.dumps(result))
    else:
        stats = final.spec
        print(
            f"\n[{len(token_ids)} tokens, {tokens_per_s:.1f} tokens/s, "
            f"finish: {final.finish_reason}, "
            f"mean acceptance length {stats.mean_acceptance_length:.2f}]",
            file=sys.stderr,
        )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from router.simple_server import serve  # the HTTP layer is only needed here

    loaded = load(args)
    serve(loaded, args.host, args.port)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "k8s":
            return k8s.run(args)
        return _serve(args)
    except (ValueError, FileNotFoundError, k8s.K8sError) as exc:
        print(f"outrider: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
