"""EAGLE's capture-ready draft loop (workers/drafting/eagle_loop.py): run eagerly on the CPU,
its static shapes, persistent buffers and padding give the eager drafter's proposals token for
token, through verify steps that accept anything from none to all of a draft. `pytest -m cuda`
runs the first test again with the loop's graphs captured and replayed (fp32, TF32 off)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.factories import tiny_eagle_head, tiny_model
from workers.drafting.base import DraftRequest
from workers.drafting.eagle import EagleDrafter
from workers.drafting.eagle_loop import LoopConfig
from workers.engine.sampling_params import SamplingParams
from workers.model.transformer import TransformerLM

GREEDY = SamplingParams(temperature=0.0)
K = 4


@pytest.fixture(scope="module")
def target() -> TransformerLM:
    return tiny_model(seed=3)


def cuda_target() -> Iterator[TransformerLM]:
    """Heads of 16 dimensions, so that the loop attends with the Triton kernel."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield tiny_model(seed=3, head_dim=16).to("cuda")
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture(
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ]
)
def any_target(request: pytest.FixtureRequest, target: TransformerLM) -> Iterator[TransformerLM]:
    if request.param == "cpu":
        yield target
    else:
        yield from cuda_target()


def drafters(target: TransformerLM, **kwargs: object) -> tuple[EagleDrafter, EagleDrafter]:
    """(eager, looped) drafters over one head."""
    head = tiny_eagle_head(target)
    eager = EagleDrafter(head, target, num_blocks=64, block_size=4, **kwargs)  # type: ignore[arg-type]
    looped = EagleDrafter(
        head,
        target,
        num_blocks=64,
        block_size=4,
        loop=LoopConfig(max_seqs=4, max_depth=K),
        **kwargs,  # type: ignore[arg-type]
    )
    return eager, looped


def test_the_loop_proposes_what_the_eager_drafter_proposes(any_target: TransformerLM) -> None:
    """Five sequences (one more than the loop's largest batch), contexts of 6-17 tokens,
    through twelve rounds whose verifiers accept 0..k drafts; the sampled one stays eager."""
    target = any_target
    eager, looped = drafters(target)
    on_gpu = target.device.type == "cuda"
    if on_gpu:
        report = looped.capture()
        assert report is not None and report.num_graphs == 3 * K  # batch sizes 1, 2, 4
    width = len(eager.head.config.target_layers) * target.config.hidden_size
    gen = torch.Generator().manual_seed(7)
    lengths = [6, 9, 13, 17, 8]
    features = [torch.randn(64, width, generator=gen).to(target.device) for _ in lengths]
    tokens = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in lengths]
    params = [GREEDY] * 4 + [SamplingParams(temperature=0.8, seed=5)]
    rids = [f"r{i}" for i in range(len(lengths))]
    for drafter in (eager, looped):
        for rid, prompt, p, f in zip(rids, tokens, params, features, strict=True):
            drafter.add(rid, prompt, p)
            drafter.observe_hidden(rid, 0, f[: len(prompt) - 1])
    assert looped.loop is not None
    for step in range(12):
        ks = [1 + (step + i) % K for i in range(len(rids))]
        requests = [
            DraftRequest(rid, len(t), k) for rid, t, k in zip(rids, tokens, ks, strict=True)
        ]
        if step == 5:  # asked twice without a verify between: the last feature row again
            assert eager.propose(requests).keys() == looped.propose(requests).keys()
        want, got = eager.propose(requests), looped.propose(requests)
        for i, rid in enumerate(rids):
            assert got[rid].token_ids == want[rid].token_ids, (step, rid)
            # The verifier accepts some drafts and adds its own token; features follow.
            draft = want[rid].token_ids
            accepted = draft[: (step * 3 + i) % (len(draft) + 1)]
            committed = [*accepted, 50 + step]
            start = len(tokens[i]) - 1
            for drafter in (eager, looped):
                drafter.observe_hidden(rid, start, features[i][start : start + len(committed)])
                drafter.commit(rid, committed)
            tokens[i] += committed
    # The drafts came from the loop, not the eager path.
    assert (looped.loop.num_replays if on_gpu else looped.loop.num_eager_runs) >= 10
    for drafter in (eager, looped):
        for rid in rids:
            drafter.remove(rid)
        assert drafter.allocator.num_free_blocks == 64


def test_a_loop_draft_ends_where_the_eager_one_does(target) -> None:  # type: ignore[no-untyped-def]
    """Under confidence bars from none to one no draft meets, the loop's drafts (it always
    drafts k, the host cuts) equal the eager drafter's, which stops drafting at the bar."""
    head = tiny_eagle_head(target)
    width = len(head.config.target_layers) * target.config.hidden_size
    features = torch.randn(9, width, generator=torch.Generator().manual_seed(1))
    lengths = set()
    for bar in (0.0, 0.5, 0.9, 0.99, 0.999, 1 - 1e-9):
        drafts = []
        for loop in (None, LoopConfig(max_seqs=2, max_depth=K)):
            drafter = EagleDrafter(
                head, target, num_blocks=32, block_size=4, min_confidence=bar, loop=loop
            )
            drafter.add("a", list(range(10)), GREEDY)
            # The prompt's features in two parts: the loop reads the second (two rows).
            drafter.observe_hidden("a", 0, features[:7])
            drafter.propose([DraftRequest("a", 10, 1)])
            drafter.observe_hidden("a", 7, features[7:])
            drafts.append(drafter.propose([DraftRequest("a", 10, K)])["a"].token_ids)
        assert drafts[0] == drafts[1], bar
        lengths.add(len(drafts[0]))
    assert len(lengths) >= 2 and 1 in lengths and K in lengths


def test_the_loop_out_of_cache_blocks_gives_an_empty_draft(target) -> None:  # type: ignore[no-untyped-def]
    """A prompt's many feature rows go into the head's cache in one eager forward, then the
    loop drafts; where the head's cache (3 blocks of 4 rows) runs out, in that catch-up or in
    the loop, the draft is empty and the sequence starts over from its next features."""
    head = tiny_eagle_head(target)
    drafter = EagleDrafter(
        head, target, num_blocks=3, block_size=4, loop=LoopConfig(max_seqs=1, max_depth=K)
    )
    assert drafter.loop is not None
    width = len(head.config.target_layers) * target.config.hidden_size
    features = torch.randn(16, width, generator=torch.Generator().manual_seed(2))
    drafter.add("a", list(range(12)), GREEDY)
    drafter.observe_hidden("a", 0, features[:11])
    # 10 rows caught up, the 11th and its draft of 1 in the loop: 11 rows.
    assert len(drafter.propose([DraftRequest("a", 12, 1)])["a"].token_ids) == 1
    assert drafter.loop.num_eager_runs == 1
    drafter.observe_hidden("a", 11, features[11:12])
    drafter.commit("a", [5])
    # 12 feature rows and 3 more for a draft of K need 4 blocks of 4: one short.
    assert drafter.propose([DraftRequest("a", 13, K)])["a"].token_ids == []
    assert drafter.loop.num_eager_runs == 1
    # Started over: the next features are its first, and 14 of them overflow the catch-up.
    drafter.observe_hidden("a", 0, features[:14])
    drafter.commit("a", [6, 7])
    assert drafter.propose([DraftRequest("a", 15, K)])["a"].token_ids == []
    assert drafter.loop.num_eager_runs == 1
    drafter.remove("a")
    assert drafter.allocator.num_free_blocks == 3


def test_the_loops_launch_is_timed_apart_from_its_depths(target) -> None:  # type: ignore[no-untyped-def]
    """`token_seconds` with the loop: what a depth adds (the token's price), the proposal's
    fixed part (`launch_seconds`) and a further sequence's share; nothing is left behind."""
    head = tiny_eagle_head(target)
    loop = LoopConfig(max_seqs=4, max_depth=K)
    drafter = EagleDrafter(head, target, num_blocks=64, block_size=4, loop=loop)
    depth = drafter.token_seconds(context=8, reps=2, rows=3)
    # Measured (a difference of two timings: on a loaded machine it may clamp to 0).
    assert depth >= 0 and drafter.launch_seconds is not None and drafter.launch_seconds >= 0
    assert drafter.row_seconds is not None and drafter.row_seconds >= 0
    assert drafter.loop is not None and drafter.loop.num_eager_runs > 0
    assert not drafter._seqs and drafter.allocator.num_free_blocks == 64
