"""Router fixtures: real redis-server processes and routers on loopback over a real engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from router.redis_server import EmbeddedRedis
from tests.router.helpers import RunningRouter, start_router


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="module")
def local_engine(model_fp32, checkpoint, redis_server):  # type: ignore[no-untyped-def]
    """An in-process engine (fp32, an ngram drafter following the shared n-gram pool of the
    open router's Redis database) behind an EngineLoop."""
    from cluster.ngram_pool import follow
    from workers.drafting.ngram import NgramDrafter
    from workers.engine.config import EngineConfig, SpecConfig
    from workers.engine.engine_loop import EngineLoop
    from workers.engine.llm_engine import LLMEngine

    # Fixed k (no adaptive k): what a request drafts must not hang on the start-up timing of
    # verify costs, which on a CPU where a 4-token fp32 forward costs two 1-token ones leaves
    # adaptive k near its break-even and the acceptance counts below to chance.
    config = EngineConfig(max_model_len=256, spec=SpecConfig(method="none", adaptive=False))
    engine = LLMEngine(
        model_fp32,
        config,
        tokenizer=checkpoint.tokenizer,
        eos_token_ids=checkpoint.config.eos_token_ids,
        drafters={"ngram": NgramDrafter()},
    )
    url = f"redis://127.0.0.1:{redis_server.port}/1"
    follower = follow(engine.speculator.drafters, url, None)
    loop = EngineLoop(engine)
    yield loop
    loop.close()
    assert follower is not None
    follower.stop()


@pytest.fixture(scope="module")
def open_router(local_engine, checkpoint, redis_server) -> Iterator[RunningRouter]:  # type: ignore[no-untyped-def]
    """A router without API keys over the local engine (its own Redis database)."""
    from router.backends import LocalBackend

    running = start_router(LocalBackend(local_engine), checkpoint.tokenizer, redis_server, db=1)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def server(open_router) -> str:  # type: ignore[no-untyped-def]
    """The URL of the module's router (`open_router`)."""
    return open_router.url
