"""The GPU section of docs/benchmarks.md from bench_gpu's results (`--render run.json [...]`).

The first file is a whole run; later ones (runs of some parts, with `--parts`, and another
`--k`, say) add their single-stream tables beside it. Kept apart from bench_gpu.py because it
imports the report helpers, which the GPU machines' images need not hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.benchmarks.report import DEFAULT_REPORT, table, write_section

SECTION = "bench_gpu"
COMMAND = "python -m tests.benchmarks.bench_gpu"


def _f(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def _x(x: float) -> str:
    return f"{x:.2f}x"


def goals(run: dict[str, Any]) -> str:
    """The issue's goals as ratios within the run, each with its target and whether it holds."""
    rows = []
    single, hf = run.get("single", {}).get("tokens_per_s", {}), run.get("hf_static", {})
    if single and hf and "error" not in hf:
        for kind, by_method in single.items():
            ratio = by_method["none"] / hf[kind]
            rows.append(
                [
                    f"plain single stream vs static-cache `generate`, {kind}",
                    _x(ratio),
                    ">= 2x",
                    ratio >= 2,
                ]
            )
    levels = run.get("concurrency", {}).get("tokens_per_s", {})
    batch = run.get("hf_static_batch", {})
    if "64" in levels and "tokens_per_s" in batch:
        ratio = levels["64"]["none"] / batch["tokens_per_s"]
        rows.append(
            [
                "64 concurrent vs static-cache `generate` at batch 64",
                _x(ratio),
                ">= 1.2x",
                ratio >= 1.2,
            ]
        )
    forward = run.get("forward", {})
    if "graph_ms" in forward:
        ms = dict(zip(forward["counts"], forward["graph_ms"], strict=True))
        ratio = ms[5] / ms[1]
        rows.append(
            [
                "verify forward of 1 + 4 tokens vs a decode step",
                _x(ratio),
                "<= 1.15x",
                ratio <= 1.15,
            ]
        )
    if single:
        ratio = single["code edit"]["ngram"] / single["code edit"]["none"]
        rows.append(
            ["ngram vs plain, code edit, single stream", _x(ratio), ">= 2.5x", ratio >= 2.5]
        )
        trees = run.get("tree_nodes", 0)
        for kind, by_method in single.items():
            if "eagle" in by_method:
                # Issue 50's goals with trees, issue 49's with chains.
                chat = kind == "open chat"
                want = (2 if chat else 2.5) if trees else (1.6 if chat else 2)
                ratio = by_method["eagle"] / by_method["none"]
                drafter = f"eagle (trees of {trees})" if trees else "eagle"
                rows.append(
                    [
                        f"{drafter} vs plain, {kind}, single stream",
                        _x(ratio),
                        f">= {want}x",
                        ratio >= want,
                    ]
                )
    cost = run.get("engine", {}).get("draft_costs", {}).get("eagle")
    if cost is not None:
        rows.append(
            [
                "an EAGLE draft depth, in one-token target forwards",
                f"{cost:.3f}",
                "<= 0.08",
                cost <= 0.08,
            ]
        )
    for level in ("16", "64", "256"):
        for method in levels.get(level, {}):
            if method != "none":
                ratio = vs_none(run, level, method)
                rows.append(
                    [f"{method} vs plain, {level} concurrent", _x(ratio), ">= 0.95x", ratio >= 0.95]
                )
    big = run.get("llama_8b_shape", {})
    if "step_ms" in big:
        for batch_size in ("1", "64"):
            ratio = big["step_ms"][batch_size] / big["step_floor_ms"][batch_size]
            rows.append(
                [
                    f"8B-shaped decode step, batch {batch_size}, vs its floor",
                    _x(ratio),
                    "<= 1.25x",
                    ratio <= 1.25,
                ]
            )
    marked = [[name, value, goal, "yes" if met else "**no**"] for name, value, goal, met in rows]
    return table(["goal", "measured", "target", "met"], marked)  # fmt: skip


def forward_table(run: dict[str, Any]) -> str:
    forward = run["forward"]
    decode = forward["graph_ms"][0]
    rows = [
        [n, _f(g, 2), _f(e, 2), _x(g / decode)]
        for n, g, e in zip(forward["counts"], forward["graph_ms"], forward["eager_ms"], strict=True)
    ]
    return table(["new tokens", "graph ms", "eager ms", "vs one token (graph)"], rows)


def single_table(run: dict[str, Any], with_hf: bool) -> str:
    single = run["single"]
    rows = []
    for kind, by_method in single["tokens_per_s"].items():
        row = [kind]
        for method, rate in by_method.items():
            accepted = single["acceptance"][kind][method]
            shown = f"{_f(rate)} ({_x(rate / by_method['none'])}, {accepted:.2f})"
            row.append(_f(rate) if method == "none" else shown)
        if with_hf:
            row += [_f(run[part][kind]) for part in ("hf_static", "hf_eager", "hf_lookup")]
        rows.append(row)
    header = ["prompts", *single["tokens_per_s"]["code edit"]]
    if with_hf:
        header += ["`generate` static cache", "`generate` eager", "`generate` prompt lookup 10"]
    return table(header, rows)


def steps_table(run: dict[str, Any]) -> str:
    rows = [
        [
            case,
            v["steps"],
            v["graph_steps"],
            v.get("draft_graph_steps", "-"),
            _f(v["draft_ms"], 3),
            _f(v["rest_ms"], 3),
        ]
        for case, v in run["single"]["steps"].items()
    ]
    header = ["prompts, method", "steps", "graph replays", "draft-loop replays"]
    return table([*header, "drafting ms", "the rest ms"], rows)


def overhead_line(run: dict[str, Any]) -> list[str]:
    """What adaptive k measured a drafting sequence to add to a step, where the run has it."""
    overhead = run["single"].get("spec_overhead")
    if overhead is None:
        return []
    return [
        f"Drafting and verifying added {overhead:.2f} one-token forwards a drafting sequence "
        "to a step beyond the forwards priced, as adaptive k measured it at the end "
        "(`Speculator.observe_step`; 0.05 at start)."
    ]


def when(extra: dict[str, Any], first: dict[str, Any]) -> str:
    """A later run's date, as the first run's section words it."""
    date = extra["environment"].get("date")
    return "the same day" if date == first["environment"].get("date") else str(date)


def vs_none(run: dict[str, Any], level: str, method: str) -> float:
    """`method` against none at `level` concurrent requests: the median of the rounds' ratios
    where the run kept them, else the ratio of its (single) rates."""
    part = run["concurrency"]
    if "vs_none" in part:
        return float(part["vs_none"][level][method])
    rates = part["tokens_per_s"][level]
    return float(rates[method] / rates["none"])


def concurrency_table(run: dict[str, Any]) -> str:
    levels = run["concurrency"]["tokens_per_s"]
    rows = []
    for level, by_method in levels.items():
        row = [level]
        for method, rate in by_method.items():
            ratio = "" if method == "none" else f" ({_x(vs_none(run, level, method))})"
            row.append(_f(rate) + ratio)
        rows.append(row)
    return table(["concurrent requests", *levels["1"]], rows)  # fmt: skip


def equal_work_lines(run: dict[str, Any]) -> list[str]:
    """The concurrency part's runs with equal work, beside transformers' static batch."""
    equal = run["concurrency"].get("equal_work_tokens_per_s", {})
    if not equal:
        return []
    ours = ", ".join(f"{level} requests {_f(rate)} tokens/s" for level, rate in equal.items())
    hf = run.get("hf_static_batch", {})
    peer = (
        f" (transformers' static-cache batch of {hf['batch']}: {_f(hf['tokens_per_s'])})"
        if "tokens_per_s" in hf
        else ""
    )
    tokens = run["concurrency"].get("max_tokens", 128)
    return [f"Every request {tokens} tokens (EOS ignored), no speculation: {ours}{peer}."]


def eight_b_table(run: dict[str, Any]) -> str:
    big = run["llama_8b_shape"]
    served = all(big["decode"][b].get("decode_step_ms") for b in ("1", "64"))
    rows = [
        [
            b,
            _f(big["step_ms"][b], 2),
            _f(big["step_floor_ms"][b], 2),
            _x(big["step_ms"][b] / big["step_floor_ms"][b]),
            *([_f(big["decode"][b]["decode_step_ms"], 2)] if served else []),
            _f(big["decode"][b]["tokens_per_s"]),
        ]
        for b in ("1", "64")
    ]
    head = ["batch", "decode step ms", "floor ms", "vs floor"]
    head += ["served decode step ms"] if served else []
    steps = table([*head, "tokens/s, 128-token answers"], rows)
    one = big["forward_ms"][0]
    costs = table(
        ["new tokens", *(str(n) for n in big["counts"])],
        [
            ["ms", *(_f(ms, 2) for ms in big["forward_ms"])],
            ["vs one", *(_x(ms / one) for ms in big["forward_ms"])],
        ],
    )
    return (
        steps
        + "\n\nOne forward of n new tokens of one sequence (graphs up to 17, 64 eager):\n\n"
        + costs
    )


def draft_loop_section(profile: dict[str, Any]) -> list[str]:
    """profile_draft_loop's results: a proposal's and its replay's time by depth and batch,
    and the kernels of one deepest replay."""
    rows = []
    for batch in ("1", "4"):
        for depth, t in profile[f"batch_{batch}"].items():
            rows.append([batch, depth, _f(t["proposal_ms"], 3), _f(t["replay_ms"], 3)])
    day = profile.get("date", "the day of the first run above")
    kernels = profile["kernels"]
    top = [[name, count, _f(us, 1)] for name, count, us in kernels["top"][:8]]
    return [
        "### EAGLE's draft loop",
        f"`python -m tests.benchmarks.profile_draft_loop` ({profile.get('card', '?')}, "
        f"{day}): the bundled head over a one-layer target of the bundled model's width with "
        f"random weights, {profile['context']} rows of history; a proposal as the engine "
        "makes it (staging, replay, read-back, the host's bookkeeping) and its graph's replay "
        "alone, median ms.",
        table(["sequences", "depth", "proposal ms", "replay ms"], rows),
        f"One replay at depth {profile['k']} for one sequence runs {kernels['kernels']} kernels "
        f"in {_f(kernels['gpu_ms'], 3)} ms of GPU time; the costliest:",
        table(["kernel", "calls", "GPU us"], top),
        *catch_up_lines(profile),
    ]


def catch_up_lines(profile: dict[str, Any]) -> list[str]:
    """One sequence's catch-up (its new feature rows into the head's cache, eagerly, before
    the loop drafts) by rows, where the profile measured it."""
    times = profile.get("catch_up_ms")
    if not times:
        return []
    cells = ", ".join(f"{rows} rows {_f(ms, 2)} ms" for rows, ms in times.items())
    return [f"A sequence's catch-up before its first loop proposal (eager, median): {cells}."]


def deterministic_section(
    part: dict[str, Any], extra: dict[str, Any], first: dict[str, Any]
) -> list[str]:
    """bench_gpu_deterministic's part of the run `extra` (`first`'s when it is that run)."""
    if "error" in part:
        return ["### Deterministic kernels (`--deterministic`)", "The part failed."]
    modes = ("default", "deterministic")  # bench_gpu_deterministic.MODES
    default, det = (part["single_tokens_per_s"][m] for m in modes)
    rows = [[row, f"{default[row]:,.0f}", f"{det[row]:,.0f}", f"{det[row] / default[row]:.2f}x"]
            for row in default]  # fmt: skip
    default, det = (part["concurrent_tokens_per_s"][m] for m in modes)
    rows += [
        [f"{lv} concurrent, none", f"{default[lv]:,.0f}", f"{det[lv]:,.0f}",
         f"{det[lv] / default[lv]:.2f}x"]
        for lv in default
    ]  # fmt: skip
    same = part["same_text"]
    texts = "; ".join(
        f"{mode}: {same[mode]['differ_together']} together, {same[mode]['differ_ngram']} with "
        f"n-gram speculation"
        for mode in modes
    )
    return [
        "### Deterministic kernels (`--deterministic`)",
        f"Batch-invariant projections and attention beside the default kernels in one run "
        f"({extra['environment']['card']}, {when(extra, first)}, `--parts "
        f"{','.join(extra['parts'])}`): tokens/s, greedy, {part.get('max_tokens', 128)} "
        "tokens, medians over rounds that alternate the modes. Goal: at most 15% slower than "
        "the default (ratio >= 0.87x).",
        table(["", "default", "deterministic", "ratio"], rows),
        f"Greedy outputs of {same['default']['prompts']} held-out prompts that differ from "
        f"each prompt's lone run: {texts}.",
    ]


def extra_run_lines(extra: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """A later run's single-stream table (and, where it ran them, its steps, concurrency and
    goals), with the flags it ran with."""
    fixed = not extra.get("adaptive", True)
    trees = f" --tree-nodes {extra['tree_nodes']}" if extra.get("tree_nodes") else ""
    trees += " --async-scheduling" if extra.get("async_scheduling") else ""
    flags = (
        f"--k {extra['k']}{' --fixed-k' if fixed else ''}{trees} --parts {','.join(extra['parts'])}"
    )
    drafts = f"exactly {extra['k']}" if fixed else f"at most {extra['k']}"
    note = f" {extra['note']}" if "note" in extra else ""
    parts = [
        f"With {drafts} draft tokens a step ({extra['environment']['card']}, "
        f"{when(extra, run)}, `{flags}`).{note}",
        single_table(extra, with_hf=False),
    ]
    if extra.get("tree_nodes") and "concurrency" not in extra:
        parts += [steps_table(extra), goals(extra)]
    if "concurrency" in extra:  # a run of its own: its steps, concurrency and goals too
        parts += [
            steps_table(extra),
            *overhead_line(extra),
            concurrency_table(extra),
            *equal_work_lines(extra),
            goals(extra),
        ]
    return parts


def render(runs: list[dict[str, Any]], path: Path = DEFAULT_REPORT) -> None:
    profiles = [r for r in runs if "batch_1" in r]  # profile_draft_loop's, not bench_gpu's
    runs = [r for r in runs if "batch_1" not in r]
    run = runs[0]
    env = run["environment"]
    k = run.get("k", 4)
    parts = [
        f"## One GPU (`{COMMAND}`)",
        f"Card: {env['card']} ({env.get('memory_gib', '?')} GiB), torch {env['torch']}, Triton "
        f"{env.get('triton', '?')}, {env['date']}; device-to-device copy "
        f"{_f(env['copy_gb_s'] / 1000, 2)} TB/s (bytes read plus written). Model: the bundled "
        "SmolLM2-135M-Instruct in bf16; transformers runs the same weights on the same card in "
        "the same process. Greedy, 128-token answers, tokens/s including the prompt's prefill; "
        "our engine runs without a tokenizer (token ids, as `generate`), with decode and verify "
        f"steps replayed from CUDA graphs, at most {k} draft tokens a step (adaptive k) and "
        "prefill steps of up to 2048 tokens.",
        "### Goals",
        goals(run),
        "### Forward cost by new tokens",
        "One sequence over a 256-token cache: through the captured graphs (up to 16 new "
        "tokens; 64 and 256 run eagerly) and through the eager runner.",
        forward_table(run),
        "### Single stream",
        "tokens/s per method; for the speculative ones, (vs none, mean acceptance length).",
        single_table(run, with_hf=True),
        "Where a decode step's time goes (median ms per verify step):",
        steps_table(run),
        *overhead_line(run),
    ]
    for extra in runs[1:]:
        if "single" in extra:
            parts += extra_run_lines(extra, run)
        if "deterministic" in extra:
            parts += deterministic_section(extra["deterministic"], extra, run)
    for profile in profiles:
        parts += draft_loop_section(profile)
    parts += [
        "### Concurrent requests",
        "All at once, each a held-out prompt (chat, code, summaries), tokens/s over the batch; "
        "(vs none). At 8 and more unfinished requests nobody speculates (`disable_batch_size`). "
        f"transformers' static-cache `generate` at batch 64: "
        f"{_f(run['hf_static_batch']['tokens_per_s'])} tokens/s.",
        concurrency_table(run),
        *equal_work_lines(run),
        "### A model of Llama-3.1-8B's shape",
        f"Random bf16 weights made on the device ({_f(run['llama_8b_shape']['weight_gb'], 2)} "
        "GB). The floor is the bytes a step must read (the weights, and the KV cache of "
        "256-token contexts) over the measured copy rate.",
        eight_b_table(run),
    ]
    if "deterministic" in run:
        parts += deterministic_section(run["deterministic"], run, run)
    write_section(SECTION, "\n\n".join(parts), path)
