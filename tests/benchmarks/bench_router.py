"""What the router costs: the same requests straight into the engine, through the HTTP API
(the official `openai` client, streaming) and through the gRPC API, side by side.

    python -m tests.benchmarks.bench_router [--runs 3] [--quick]

One in-process engine (bundled model, bf16, ngram speculation) behind `LocalBackend`, a router
with the embedded Redis on loopback (API keys on, so every request pays the key lookup and the
rate-limit script). For each concurrency level, rounds interleave the three paths; each request
is a greedy chat completion. Reports median time to first token, median request latency and
aggregate tokens/s, and the router's overhead over the direct path. Then `n` choices: one
request for 4 sampled answers to a long new prompt against 4 requests for one each, at once,
with the prompt tokens the engine computed for each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tests.benchmarks.report import DEFAULT_REPORT, machine_line, table, write_section

KEY = "sk-bench"
QUESTIONS = [
    "Explain what a hash table is.",
    "Give three tips for writing clear emails.",
    "Why is the sky blue?",
    "Describe how a bicycle gear works.",
    "What is the difference between weather and climate?",
    "Summarise the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?",
    "Write a short note inviting a friend to dinner.",
]


def questions_for(n: int) -> list[str]:
    """`n` requests' questions: QUESTIONS over again as often as it takes."""
    return [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]


async def _direct(loop: Any, prompt: list[int], params: Any, rid: str) -> tuple[float, int]:
    start = time.perf_counter()
    ttft, n = 0.0, 0
    async for out in loop.stream(rid, prompt, params):
        if out.new_token_ids and not n:
            ttft = time.perf_counter() - start
        n += len(out.new_token_ids)
    return ttft, n


async def _http(client: Any, question: str, max_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    ttft, n = 0.0, 0
    stream = await client.chat.completions.create(
        model="bench",
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and not ttft:
            ttft = time.perf_counter() - start
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    return ttft, n


async def _grpc(stub: Any, pb2: Any, question: str, max_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    ttft, n = 0.0, 0
    request = pb2.GenerateRequest(
        chat=pb2.ChatMessages(messages=[pb2.ChatMessage(role="user", content=question)]),
        max_tokens=max_tokens,
        temperature=0.0,
    )
    async for response in stub.Generate(request, metadata=[("authorization", f"Bearer {KEY}")]):
        if response.token_ids and not n:
            ttft = time.perf_counter() - start
        n += len(response.token_ids)
    return ttft, n


async def _round(
    path: str, concurrency: int, ctx: dict[str, Any], max_tokens: int
) -> tuple[list[float], list[float], int, float]:
    questions = questions_for(concurrency)
    start = time.perf_counter()

    async def one(i: int, q: str) -> tuple[float, int, float]:
        t0 = time.perf_counter()
        if path == "direct":
            tok = ctx["tokenizer"]
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
            ttft, n = await _direct(ctx["loop"], ids, ctx["params"], f"d-{time.time_ns()}-{i}")
        elif path == "HTTP (openai client)":
            ttft, n = await _http(ctx["client"], q, max_tokens)
        else:
            ttft, n = await _grpc(ctx["stub"], ctx["pb2"], q, max_tokens)
        return ttft, n, time.perf_counter() - t0

    results = await asyncio.gather(*(one(i, q) for i, q in enumerate(questions)))
    wall = time.perf_counter() - start
    return [r[0] for r in results], [r[2] for r in results], sum(r[1] for r in results), wall


CHOICES = 4
LONG_PROMPT = "Summarize the following notes in two sentences. " + " ".join(
    f"Note {i}: the meeting moved the release of part {i} by {i % 5 + 1} days." for i in range(24)
)


async def _choices_round(
    ctx: dict[str, Any], mode: str, nonce: int, max_tokens: int
) -> tuple[float, int]:
    """(seconds until every answer is in, prompt tokens the engine computed): one request with
    `n` 4, or 4 requests with the seeds the choices get; a new prompt each time."""
    client, computed = ctx["client"], ctx["computed"]
    prompt = f"[{nonce}] {LONG_PROMPT}"
    common = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8}
    before = sum(computed)
    start = time.perf_counter()
    if mode == "one request, n = 4":
        await client.completions.create(**common, n=CHOICES, seed=nonce)
    else:
        await asyncio.gather(
            *(client.completions.create(**common, seed=nonce + i) for i in range(CHOICES))
        )
    return time.perf_counter() - start, sum(computed) - before


async def _measure_choices(ctx: dict[str, Any], runs: int, max_tokens: int) -> list[list[str]]:
    modes = ["one request, n = 4", "4 requests at once"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    prompt_tokens: dict[str, list[int]] = {m: [] for m in modes}
    for round_ in range(runs + 1):  # round 0 warms up
        for number, mode in enumerate(modes):
            seconds, computed = await _choices_round(ctx, mode, 1000 * round_ + number, max_tokens)
            if round_:
                times[mode].append(seconds)
                prompt_tokens[mode].append(computed)
    base = times[modes[1]]
    return [
        [
            mode,
            f"{statistics.median(times[mode]) * 1000:.0f} ms",
            f"{statistics.median(b / t for b, t in zip(base, times[mode], strict=True)):.2f}x",
            f"{statistics.median(prompt_tokens[mode]):.0f}",
        ]
        for mode in modes
    ]


async def _measure(ctx: dict[str, Any], levels: list[int], runs: int, max_tokens: int) -> Any:
    import grpc

    from router.proto import generate_pb2, generate_pb2_grpc

    paths = ["direct", "HTTP (openai client)", "gRPC"]
    stats: dict[tuple[str, int], dict[str, list[float]]] = {
        (p, c): {"ttft": [], "latency": [], "tps": []} for p in paths for c in levels
    }
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ctx['grpc_port']}") as channel:
        ctx["stub"], ctx["pb2"] = generate_pb2_grpc.GenerationStub(channel), generate_pb2
        for round_ in range(runs + 1):  # round 0 warms up
            for c in levels:
                for path in paths:
                    ttft, latency, tokens, wall = await _round(path, c, ctx, max_tokens)
                    if round_:
                        s = stats[(path, c)]
                        s["ttft"] += ttft
                        s["latency"] += latency
                        s["tps"].append(tokens / wall)
            print(f"[bench_router] round {round_}/{runs}", file=sys.stderr)
    return paths, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", type=Path, default=DEFAULT_REPORT)
    args = parser.parse_args()
    levels = [1, 8]
    if args.quick:
        args.runs, args.max_tokens, levels = 1, 4, [1, 2]

    import openai

    from router.backends import LocalBackend
    from router.keys import KeyLine
    from router.protocol import RequestBuilder
    from router.redis_server import EmbeddedRedis
    from router.server import Router, RouterOptions, RouterThread
    from workers.engine.config import EngineConfig, SpecConfig
    from workers.engine.engine_loop import EngineLoop
    from workers.engine.factory import ModelSpec, build_engine
    from workers.engine.sampling_params import SamplingParams

    loaded = build_engine(
        ModelSpec(dtype="bfloat16"),
        EngineConfig(max_model_len=1024, max_num_seqs=16, spec=SpecConfig(method="ngram")),
        progress=False,
    )
    computed: list[int] = []  # prompt tokens of each prefill chunk the engine ran
    loaded.engine.step_listeners.append(
        lambda report: computed.extend(r.prefill_tokens for r in report.rounds)
    )
    loop = EngineLoop(loaded.engine)
    redis = EmbeddedRedis().start()
    options = RouterOptions(
        port=0,  # the ports the OS chooses as the router binds them
        grpc_port=0,
        redis_url=redis.url,
        api_keys=[KeyLine(KEY, "bench", 0.0, 0)],
    )
    builder = RequestBuilder(loaded.tokenizer, "bench", 1024)
    router = Router(LocalBackend(loop), builder, options)
    thread = RouterThread(router).start()
    port, grpc_port = router.port, router.grpc_port
    ctx: dict[str, Any] = {
        "loop": loop,
        "tokenizer": loaded.tokenizer,
        "params": SamplingParams(max_tokens=args.max_tokens, temperature=0),
        "grpc_port": grpc_port,
        "computed": computed,
    }
    try:

        async def run() -> Any:
            ctx["client"] = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0
            )
            measured = await _measure(ctx, levels, args.runs, args.max_tokens)
            return measured, await _measure_choices(ctx, args.runs, args.max_tokens)

        (paths, stats), choice_rows = asyncio.run(run())
    finally:
        thread.stop()
        redis.stop()
        loop.close()

    rows = []
    for c in levels:
        base = stats[("direct", c)]
        for path in paths:
            s = stats[(path, c)]
            ttft, lat = statistics.median(s["ttft"]), statistics.median(s["latency"])
            overhead = (
                ""
                if path == "direct"
                else f"{(lat - statistics.median(base['latency'])) * 1000:+.0f} ms"
            )
            rows.append(
                [
                    c,
                    path,
                    f"{ttft * 1000:.0f} ms",
                    f"{lat * 1000:.0f} ms",
                    overhead,
                    f"{statistics.median(s['tps']):.1f}",
                ]
            )
    body = "\n\n".join(
        [
            "## Router overhead\n\n`python -m tests.benchmarks.bench_router`",
            f"Machine: {machine_line()}. Bundled model in one in-process engine (bf16, ngram "
            f"speculation, adaptive k), greedy chat completions of up to {args.max_tokens} "
            "tokens, `c` requests at once, medians over "
            f"{args.runs} interleaved rounds. HTTP and gRPC go through the router on loopback "
            "with API keys and the rate-limit script in the embedded Redis, registry and "
            "prefix-index writes; the engine, the router and the clients share the machine's "
            "two cores.",
            table(
                [
                    "c",
                    "path",
                    "time to first token",
                    "request latency",
                    "router overhead (latency)",
                    "tokens/s (all requests)",
                ],
                rows,
            ),
        ]
    )
    prompt_len = len(loaded.tokenizer.encode(LONG_PROMPT)) + 4
    body += (
        f"\n\n### Choices\n\n{CHOICES} sampled answers (temperature 0.8, up to "
        f"{args.max_tokens} tokens each) to a new prompt of about {prompt_len} tokens over "
        "HTTP: one request with `n` 4 against 4 requests at once with the seeds the choices "
        "get (so the same answers), medians of "
        f"{args.runs} interleaved rounds; `speed-up` is the median of per-round ratios. The "
        "choices of one request run in one verifier group, the first alone until its first "
        "token puts the prompt's blocks in the prefix cache; separate requests that arrive "
        "together each compute the prompt.\n\n"
        + table(["requests", "all answers in", "speed-up", "prompt tokens computed"], choice_rows)
    )
    print(body)
    write_section("bench_router", body, args.output)


if __name__ == "__main__":
    main()
