"""The load generator's pieces: workload files, arrival schedules, the SSE parser, level
summaries, the routers' metrics and the report files. The real path (a router on loopback) is in
tests/router/test_load_tests.py."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
from pathlib import Path

import numpy as np
import pytest

from load_tests import report
from load_tests.clients import RequestRecord, SseParser
from load_tests.runner import Level, run_level
from load_tests.server_metrics import ServerView, counter_growth, growth_by, parse, total
from load_tests.stats import Slo, percentile, summarize, time_per_output_token
from load_tests.workload import (
    FOLLOW_UPS,
    RandomWorkload,
    WorkItem,
    arrival_offsets,
    load_workload,
)


def test_percentile_matches_numpy() -> None:
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(percentile([], 50))


def test_sse_parser_reads_events_cut_anywhere() -> None:
    events = [{"choices": [{"delta": {"content": "Hi"}}]}, {"usage": {"prompt_tokens": 3}}]
    stream = (
        b": a comment\r\n"
        + b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)
        + b"data: first line\ndata: second line\n\n"
        + b"data: [DONE]\n\n"
    )
    expected = [json.dumps(e) for e in events] + ["first line\nsecond line", "[DONE]"]
    for cut in range(1, 12):
        parser, got = SseParser(), []
        for i in range(0, len(stream), cut):
            got += parser.feed(stream[i : i + cut])
        assert got == expected


def test_workload_file_checks_each_line(tmp_path: Path) -> None:
    shipped = load_workload()
    assert len(shipped.items) >= 30
    assert {"chat", "code", "summary", "multi-turn", "completion"} <= {
        i.kind for i in shipped.items
    }
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n\n{"kind": "chat"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: .*one of messages, a prompt"):
        load_workload(bad)
    bad.write_text('{"prompt": "a", "max_tokens": 0}\n')
    with pytest.raises(ValueError, match=r":1: max_tokens"):
        load_workload(bad)
    bad.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        load_workload(bad)


def test_workload_stream_is_seeded_and_covers_every_item() -> None:
    workload = load_workload()
    n = len(workload.items)
    first = [next(s) for s in [workload.stream(3)] for _ in range(2 * n)]
    again = workload.stream(3)
    assert first == [next(again) for _ in range(2 * n)]
    assert sorted(map(id, first[:n])) == sorted(map(id, workload.items))


def test_poisson_offsets_have_the_rate() -> None:
    offsets = arrival_offsets(4.0, 20_000, seed=1)
    assert offsets[0] == 0.0 and offsets == arrival_offsets(4.0, 20_000, seed=1)
    gaps = np.diff(offsets)
    assert (gaps > 0).all()
    # The mean of 20,000 exponential gaps has a standard deviation of 0.7% of 1/rate.
    assert float(gaps.mean()) == pytest.approx(0.25, rel=0.04)
    with pytest.raises(ValueError):
        arrival_offsets(0.0, 3, seed=0)


def test_bursty_arrivals_keep_the_rate_and_spread_as_gamma_gaps() -> None:
    """Gamma gaps of shape b have mean 1/rate and a coefficient of variation of 1/sqrt(b)."""
    for burstiness in (0.25, 4.0):
        gaps = np.diff(arrival_offsets(4.0, 20_000, seed=2, burstiness=burstiness))
        assert float(gaps.mean()) == pytest.approx(0.25, rel=0.05)
        cv = float(gaps.std() / gaps.mean())
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    with pytest.raises(ValueError):
        arrival_offsets(1.0, 3, seed=0, burstiness=0.0)


def test_random_workload_has_the_lengths_and_is_seeded() -> None:
    fixed = RandomWorkload(64, 32)
    items = [next(s) for s in [fixed.stream(1)] for _ in range(20)]
    assert all(len(i.prompt_ids) == 64 and i.max_tokens == 32 for i in items)
    assert all(1000 <= t < 32000 for i in items for t in i.prompt_ids)
    assert len({i.prompt_ids for i in items}) == 20 and all(i.index == -1 for i in items)
    again = fixed.stream(1)
    assert items == [next(again) for _ in range(20)]
    spread = RandomWorkload(100, 50, range_ratio=0.5).stream(0)
    lengths = [(len(i.prompt_ids), i.max_tokens or 0) for i in (next(spread) for _ in range(500))]
    assert min(n for n, _ in lengths) >= 50 and max(n for n, _ in lengths) <= 150
    assert 40 < statistics.mean(m for _, m in lengths) < 60
    assert len({n for n, _ in lengths}) > 50
    for bad in ((0, 8), (8, 0)):
        with pytest.raises(ValueError):
            RandomWorkload(*bad)
    with pytest.raises(ValueError):
        RandomWorkload(8, 8, range_ratio=1.0)
    line = report._workload_line(fixed.describe("x"), 0)
    assert "random token ids in [1000, 32000), 64 prompt tokens and 32 new tokens" in line


def test_level_checks_and_names() -> None:
    assert Level(8, concurrency=1).name == "1 user"
    assert Level(8, concurrency=4).name == "4 users"
    assert Level(8, rate=0.5, max_concurrency=2).name == "0.5 req/s, <= 2 in flight"
    assert Level(8, rate=2.0, burstiness=0.5).name == "2 req/s, burstiness 0.5"
    for bad in (
        {"concurrency": 2, "rate": 1.0},
        {},
        {"concurrency": 0},
        {"rate": -1.0},
        {"rate": 1.0, "max_concurrency": 0},
        {"rate": 1.0, "burstiness": 0.0},
        {"concurrency": 1, "burstiness": 2.0},
    ):
        with pytest.raises(ValueError):
            Level(4, **bad)  # type: ignore[arg-type]


def _record(start: float, ttft: float, latency: float, tokens: int, **kw: object) -> RequestRecord:
    chunks = [ttft + i * (latency - ttft) / max(1, tokens - 1) for i in range(tokens)]
    return RequestRecord(
        "lvl", "http", "chat", start, start, ttft, latency, chunks, 10, tokens, **kw
    )  # type: ignore[arg-type]


def test_summary_of_a_level() -> None:
    records = [
        _record(0.0, 0.1, 1.1, 11, drafted=8, accepted=4, verify_steps=6),
        _record(0.5, 0.3, 2.3, 21, drafted=0, accepted=0, verify_steps=20),
        RequestRecord("lvl", "http", "chat", 1.0, 1.0, latency=0.01, status="429"),
        RequestRecord("lvl", "http", "chat", 1.0, 1.0, latency=0.01, status="429"),
    ]
    slo = Slo(ttft_s=0.2, tpot_s=0.15)
    s = summarize("lvl", records, slo)
    assert (s.sent, s.ok, s.refused) == (4, 2, {"429": 2})
    assert s.duration_s == pytest.approx(2.8)  # from 0.0 to the second request's end
    assert s.requests_per_s == pytest.approx(2 / 2.8)
    assert s.output_tokens_per_s == pytest.approx(32 / 2.8)
    assert time_per_output_token(records[0]) == pytest.approx(0.1)
    assert s.tpot_s["p50"] == pytest.approx(0.1)
    assert s.ttft_s["p50"] == pytest.approx(0.2)
    assert s.itl_s["p50"] == pytest.approx(0.1)
    assert s.mean_acceptance_length == pytest.approx((4 + 26) / 26)
    assert s.goodput_per_s == pytest.approx(1 / 2.8)  # the second misses the TTFT bound
    assert summarize("lvl", []).sent == 0


def test_router_metrics_growth() -> None:
    from router.metrics import RouterMetrics

    metrics = RouterMetrics()
    metrics.requests.labels("chat", "ok").inc()
    before = parse(metrics.render().decode())
    for _ in range(3):
        metrics.requests.labels("chat", "ok").inc()
        metrics.ttft.observe(0.2)
    metrics.requests.labels("completions", "refused").inc(2)
    metrics.generation_tokens.inc(40)
    metrics.queue_depth.labels("g0").set(3)
    metrics.routed.labels("g0", "prefix").inc()
    metrics.routed.labels("g1", "load").inc(2)
    after = parse(metrics.render().decode())
    assert growth_by(before, after, "outrider_routed_total", "reason") == {"prefix": 1, "load": 2}
    assert growth_by(before, after, "outrider_requests_total", "status") == {"ok": 3, "refused": 2}
    counters = counter_growth(before, after)
    assert counters["generated"] == 40 and counters["ttft_count"] == 3
    assert ServerView(counters=counters).mean_ttft == pytest.approx(0.2)
    assert total(after, "outrider_verifier_queue_depth", group="g0") == 3


def test_report_round_trip_and_comparison(tmp_path: Path) -> None:
    records = [_record(0.0, 0.1, 1.1, 11), _record(0.2, 0.2, 1.0, 5)]
    for r in records:
        r.level = "2 users"
    view = ServerView(requests={"ok": 2}, counters={"generated": 16}, max_queue={"g0": 2})
    run = report.Run(
        {"title": "t", "slo": {"ttft_s": 0.15, "tpot_s": None}}, ["2 users"], records, {}
    )
    run.servers["2 users"] = view
    report.save(tmp_path, run)
    loaded = report.load(tmp_path)
    assert report.render(loaded) == (tmp_path / report.REPORT).read_text()
    text = report.render(loaded)
    assert "| 2 users | 2 / 2 | 0 | - |" in text and "goodput" in text
    assert "16 / 16" in text and "g0 2" in text
    side = report.compare([("a", loaded), ("b", loaded)])
    assert side.count("| 2 users |") == 1 and "a: tok/s" in side and side.startswith("# ")


class _FakeClient:
    """Answers after a fixed delay and tracks how many requests it holds at once."""

    api = "fake"

    def __init__(self, delay: float) -> None:
        self.delay, self.open, self.most_open, self.sent = delay, 0, 0, []

    async def send(self, item: WorkItem, record: RequestRecord) -> str:
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        self.sent.append(item)
        await asyncio.sleep(self.delay)
        record.ttft, record.latency, record.output_tokens = self.delay, self.delay, 1
        if item.messages and item.messages[-1][1] == "refuse me":
            record.status = "429"
        self.open -= 1
        return f"answer {len(self.sent)}"

    async def close(self) -> None:
        pass


def test_closed_loop_keeps_its_users_busy() -> None:
    items = [WorkItem("chat", prompt=str(i)) for i in range(10)]
    client = _FakeClient(0.01)
    records = asyncio.run(run_level(client, Level(10, concurrency=3), iter(items)))
    assert client.sent == items[: len(client.sent)] and len(client.sent) == 10
    assert client.most_open == 3
    assert all(r.ok and r.scheduled == pytest.approx(r.start, abs=1e-3) for r in records)


def test_open_loop_arrives_on_schedule_under_its_cap() -> None:
    items = [WorkItem("chat", prompt=str(i)) for i in range(12)]
    client = _FakeClient(0.05)
    level = Level(12, rate=200.0, max_concurrency=2)
    records = asyncio.run(run_level(client, level, iter(items), seed=5))
    assert [r.scheduled for r in records] == arrival_offsets(200.0, 12, seed=5)
    assert client.most_open == 2
    # Arrivals faster than two can be served wait for the cap: each starts after it was due.
    assert all(r.start >= r.scheduled for r in records)
    assert statistics.mean(r.start - r.scheduled for r in records) > 0.05


def test_repeats_count_inputs_sent_earlier_in_the_run() -> None:
    levels = {"a": [0, 1, 1], "b": [1, 2, 3]}
    records = [
        RequestRecord(level, "http", "chat", 0.0, latency=0.1, output_tokens=1, item=item)
        for level, items in levels.items()
        for item in items
    ]
    run = report.Run({}, list(levels), records, {})
    assert [s.repeats for s in run.summaries()] == [1, 1]


def test_http_client_records_what_a_stream_did() -> None:
    """Against a small aiohttp server: a good stream, one cut by an error event, one not in
    OpenAI's format, a refusal, one that ends without [DONE]; and a server without /metrics is
    a clear error."""
    from aiohttp import web

    from load_tests.clients import HttpClient, Sampling
    from load_tests.server_metrics import MetricsPoller

    piece = {"choices": [{"delta": {"content": "hi"}, "finish_reason": None}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
    streams = {
        "good": [piece, piece, usage],
        "cut": [piece, {"error": {"message": "verifier lost"}}],
        "garbled": ["{not json"],
        "truncated": [piece],
    }

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        name = body["messages"][0]["content"]
        if name == "refused":
            return web.json_response({"error": {"message": "slow down"}}, status=429)
        resp = web.StreamResponse()
        await resp.prepare(request)
        for event in streams[name]:
            data = event if isinstance(event, str) else json.dumps(event)
            await resp.write(f"data: {data}\n\n".encode())
        if name != "truncated":
            await resp.write(b"data: [DONE]\n\n")
        return resp

    async def scenario() -> tuple[list[RequestRecord], str]:
        import aiohttp

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        url = f"http://127.0.0.1:{port}"
        client = HttpClient(url, Sampling(model="m"))
        records = []
        for name in ("good", "cut", "garbled", "refused", "truncated"):
            record = RequestRecord("l", "http", "chat", 0.0)
            await client.send(WorkItem("chat", messages=(("user", name),)), record)
            records.append(record)
        await client.close()
        async with aiohttp.ClientSession() as session:
            try:
                await MetricsPoller(session, [url + "/metrics"]).start()
                message = ""
            except RuntimeError as exc:
                message = str(exc)
        await runner.cleanup()
        return records, message

    (good, cut, garbled, refused, truncated), message = asyncio.run(scenario())
    assert good.ok and len(good.chunks) == 2 and good.ttft == good.chunks[0]
    assert (good.prompt_tokens, good.output_tokens) == (4, 2)
    assert (cut.status, cut.error, len(cut.chunks)) == ("failed", "verifier lost", 1)
    assert garbled.status == "bad-response"
    assert (refused.status, refused.error) == ("429", "slow down")
    assert (truncated.status, truncated.error) == ("failed", "the stream ended before [DONE]")
    assert all(r.latency is not None for r in (good, cut, garbled, refused))
    assert "--metrics-url none" in message


def test_the_first_key_of_a_router_keys_file(tmp_path: Path) -> None:
    from load_tests.__main__ import first_key, parser

    keys = tmp_path / "keys"
    keys.write_text("# operators\nsk-first-key ops 5 10\nsk-second-key\n")
    assert first_key(keys) == "sk-first-key"
    keys.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="no API keys"):
        first_key(keys)
    with pytest.raises(SystemExit):  # one key source at a time
        parser().parse_args(["run", "--api-key", "k", "--api-keys-file", str(keys)])


def test_bad_arguments_are_clear_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from load_tests.__main__ import main

    url = "http://127.0.0.1:9"  # refused before anything is sent
    for extra, message in (
        (["--metrics-interval", "0"], "--metrics-interval must be positive"),
        (["--concurrency", "2", "--max-concurrency", "2"], "apply to --rate levels"),
        (["--burstiness", "0.5"], "apply to --rate levels"),
        (["--random-input-len", "8"], "go together"),
        (["--random-input-len", "8", "--random-output-len", "0"], "at least 1"),
        (["--requests", "0"], "at least one request"),
    ):
        assert main(["run", "--url", url, *extra]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--concurrency", "0"])


def test_conversations_send_each_answer_back_with_a_follow_up() -> None:
    items = [
        WorkItem("chat", messages=(("user", "hello"),), index=0),
        WorkItem("completion", prompt="Once upon a time", index=1),
        WorkItem("chat", messages=(("user", "refuse me"),), index=2),
    ]
    client = _FakeClient(0.001)
    level = Level(3, concurrency=1, turns=3)
    assert level.name == "1 user, 3 turns"
    records = asyncio.run(run_level(client, level, iter(items), seed=4))
    # The chat runs 3 turns; a completion has no next turn; a refused turn ends its chat.
    assert [(r.item, r.turn, r.status) for r in records] == [
        (0, 1, "ok"),
        (-1, 2, "ok"),
        (-1, 3, "ok"),
        (1, 1, "ok"),
        (2, 1, "429"),
    ]
    third = client.sent[2].messages
    assert third[0] == ("user", "hello") and third[1] == ("assistant", "answer 1")
    assert third[3] == ("assistant", "answer 2") and third[2][1] in FOLLOW_UPS
    assert len(third) == 5 and third[-1][0] == "user"
    # Follow-ups are seeded: the same run asks the same questions.
    again = _FakeClient(0.001)
    asyncio.run(run_level(again, level, iter(items), seed=4))
    assert again.sent == client.sent
    text = report.render(report.Run({}, [level.name], records, {}))
    assert "## By turn of a conversation" in text and "| 1 user, 3 turns | 3 | 1 / 1 |" in text
    with pytest.raises(ValueError):
        Level(3, concurrency=1, turns=0)


def test_a_chaos_phase_counts_what_clients_lost_and_how_long_parts_took(tmp_path: Path) -> None:
    """A phase's summary: refusals are not accepted, an error event after the stream started
    is, outputs are compared with the fault-free run's character by character, and the longest
    pause is the largest gap between streamed pieces; the report renders and saves."""
    from load_tests import chaos

    def record(status: str, chunks: list[float]) -> RequestRecord:
        return RequestRecord(
            "kill verifier", "http", "completion", 0.0, status=status, chunks=chunks
        )

    records = [
        record("ok", [0.1, 0.2, 1.7, 1.8]),  # a 1.5 s pause: a migration
        record("ok", [0.1, 0.3]),
        record("failed", [0.1]),  # an error event mid-stream
        record("503", []),  # refused
    ]
    expected = ["one two three", "four five", "six", "seven"]
    got = ["one two three", "four fivefive", "", ""]
    result = chaos.summarize("kill verifier", records, got, expected, {"verifier": 12.5})
    assert (result.requests, result.accepted, result.completed, result.failed) == (4, 3, 2, 2)
    assert (result.differing, result.chars_lost, result.chars_repeated) == (1, 0, 4)
    assert result.max_pause_s == pytest.approx(1.5)
    info = {
        "command": "python -m load_tests chaos",
        "server": "s",
        "users": 2,
        "requests": 4,
        "max_tokens": 8,
        "kill_after_s": 3.0,
        "client": "c",
    }
    text = chaos.save(tmp_path, [result], info).read_text()
    assert (
        "| kill verifier | 3/4 | 2 | 2 | 1 (0 / 4) | 1.50 s" in text and "verifier 12.5 s" in text
    )
    assert json.loads((tmp_path / "chaos.json").read_text())["phases"][0]["accepted"] == 3


def test_the_chaos_command_refuses_unknown_faults(capsys: pytest.CaptureFixture[str]) -> None:
    from load_tests.__main__ import main

    assert main(["chaos", "--faults", "drafter,gremlin"]) == 2
    assert "unknown faults ['gremlin']" in capsys.readouterr().err


def test_a_shares_window_counts_what_a_running_request_had_streamed() -> None:
    """load_tests fairness's shares phase: a request that ended inside the window counts all
    its tokens, one still running at the end the share of its pieces streamed by then."""
    from load_tests.fairness import _tokens_before

    done = RequestRecord("shares", "chat", "first", 0.0, latency=0.5, output_tokens=8)
    done.chunks = [0.1 * i for i in range(1, 5)]
    assert _tokens_before(done, end=1.0) == 8
    running = RequestRecord("shares", "chat", "first", 0.0, latency=2.0, output_tokens=10)
    running.chunks = [0.2 * i for i in range(1, 11)]  # ten pieces, 0.2 s apart
    assert _tokens_before(running, end=1.0) == pytest.approx(5.0)
    assert _tokens_before(running, end=0.1) == 0.0
    silent = RequestRecord("shares", "chat", "first", 0.0, latency=2.0, output_tokens=10)
    assert _tokens_before(silent, end=1.0) == 0.0
