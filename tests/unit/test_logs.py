"""Log lines (cluster/logs.py): text or JSON, the current request's id on every line logged
while it is served (also from concurrent asyncio tasks), a request line's fields."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest

from cluster import logs


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    out = io.StringIO()
    yield out
    for handler in list(logging.getLogger().handlers):
        if isinstance(handler, logging.StreamHandler) and handler.stream is out:
            logging.getLogger().removeHandler(handler)


def test_json_lines_carry_the_request_of_their_task(captured: io.StringIO) -> None:
    logs.configure("json", captured)
    logs.configure("json", captured)  # configuring again replaces, never doubles
    log = logging.getLogger("router.test")

    async def serve(request_id: str) -> None:
        logs.REQUEST_ID.set(request_id)
        await asyncio.sleep(0)  # the other request's task runs in between
        log.info("working on it")

    async def both() -> None:
        await asyncio.gather(serve("cmpl-a"), serve("cmpl-b"))

    asyncio.run(both())
    log.warning("between requests")
    logging.getLogger("some.library").info("not ours: below WARNING, dropped")
    logs.request_line({"request_id": "cmpl-c", "outcome": "ok", "output_tokens": 5})
    rows = [json.loads(line) for line in captured.getvalue().splitlines()]
    assert [(r["message"], r.get("request_id")) for r in rows] == [
        ("working on it", "cmpl-a"),
        ("working on it", "cmpl-b"),
        ("between requests", None),
        ("request cmpl-c ok", "cmpl-c"),
    ]
    assert rows[-1]["output_tokens"] == 5 and rows[-1]["logger"] == "outrider.requests"
    assert rows[0]["level"] == "INFO" and rows[0]["time"].endswith("Z")


def test_text_lines_and_a_bad_format(captured: io.StringIO) -> None:
    logs.configure("text", captured)
    logs.request_line({"request_id": "grpc-1", "outcome": "refused", "error": "bad max_tokens"})
    (line,) = captured.getvalue().splitlines()
    assert line.endswith(
        "outrider.requests [grpc-1]: request grpc-1 refused request_id=grpc-1 outcome=refused "
        'error="bad max_tokens"'
    )
    with pytest.raises(ValueError, match="text"):
        logs.configure("yaml")
