"""The `outrider` command: `generate` (one prompt, in-process) and `serve` (HTTP API)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine
from workers.model.loader import BUNDLED_MODEL_NAME, build_model, load_checkpoint, parse_dtype
from workers.model.tokenizer import Tokenizer


@dataclass(slots=True)
class LoadedEngine:
    engine: SequentialEngine
    tokenizer: Tokenizer
    model_name: str


def load_engine(
    model: str | None, dtype: str, max_model_len: int | None = None, progress: bool = True
) -> LoadedEngine:
    """Load a model (bundled by default) and wrap it in the in-process engine."""
    checkpoint = load_checkpoint(model, progress=progress)
    net = build_model(checkpoint, dtype=parse_dtype(dtype))
    engine = SequentialEngine(
        net, eos_token_ids=checkpoint.tokenizer.eos_token_ids, max_model_len=max_model_len
    )
    return LoadedEngine(engine, checkpoint.tokenizer, model or BUNDLED_MODEL_NAME)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int, default=4096, help="context length to serve")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


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
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    _add_model_args(gen)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    _add_model_args(serve)
    return parser


def _generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    loaded = load_engine(args.model, args.dtype, args.max_model_len, progress=True)
    tok = loaded.tokenizer
    text = (
        tok.apply_chat_template([{"role": "user", "content": args.prompt}])
        if args.chat
        else args.prompt
    )
    prompt_ids = tok.encode(text)
    if args.json:
        result = loaded.engine.generate(prompt_ids, params)
        out = {
            "text": tok.decode(result.token_ids),
            "prompt_token_ids": result.prompt_token_ids,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "tokens_per_s": round(result.tokens_per_s, 2),
        }
        print(json.dumps(out))
        return 0
    printer = _StreamPrinter(tok)
    result = loaded.engine.generate(prompt_ids, params, on_tokens=printer)
    printer.flush()
    print(
        f"\n[{len(result.token_ids)} tokens, {result.tokens_per_s:.1f} tokens/s, "
        f"finish: {result.finish_reason}]",
        file=sys.stderr,
    )
    return 0


class _StreamPrinter:
    """Prints text as tokens arrive, holding back an incomplete multi-byte character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.printed = 0

    def __call__(self, new_ids: list[int]) -> None:
        self.token_ids += new_ids
        text = self.tokenizer.decode(self.token_ids)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[self.printed :])
            sys.stdout.flush()
            self.printed = len(text)

    def flush(self) -> None:
        sys.stdout.write(self.tokenizer.decode(self.token_ids)[self.printed :])
        sys.stdout.flush()


def _serve(args: argparse.Namespace) -> int:
    from router.simple_server import serve  # the HTTP layer is only needed here

    loaded = load_engine(args.model, args.dtype, args.max_model_len, progress=True)
    serve(loaded.engine, loaded.tokenizer, loaded.model_name, args.host, args.port)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.command == "generate":
            return _generate(args)
        return _serve(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"outrider: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
