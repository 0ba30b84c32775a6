"""Logit adjustments against token-by-token references: repetition, frequency and presence
penalties with their per-row counts in a verify forward, the logit bias, `min_tokens`,
`allowed_token_ids` and bad words."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.penalties import apply_penalties, position_counts
from workers.engine.sampling_params import SamplingParams


def reference(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    repetition: float,
    frequency: float,
    presence: float,
) -> list[float]:
    """One position's penalized logits, a token at a time, as vLLM documents them."""
    out = []
    for token, logit in enumerate(logits):
        if token in prompt or token in output:
            logit = logit / repetition if logit > 0 else logit * repetition
        logit -= frequency * output.count(token)
        logit -= presence * (token in output)
        out.append(logit)
    return out


@pytest.mark.parametrize(
    ("repetition", "frequency", "presence"),
    [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, -0.5), (0.8, 1.5, 2.0)],
)
def test_penalties_match_the_reference_at_every_draft_position(
    repetition: float, frequency: float, presence: float
) -> None:
    generator = torch.Generator().manual_seed(0)
    vocab = 12
    prompt, output, drafts = [0, 3, 3], [5, 7, 5], [7, 9, 1]
    logits = torch.randn(len(drafts) + 1, vocab, generator=generator) * 3
    params = SamplingParams(
        repetition_penalty=repetition, frequency_penalty=frequency, presence_penalty=presence
    )
    got = params.adjust(logits, prompt, output, drafts)
    for j in range(len(drafts) + 1):
        expected = reference(
            logits[j].tolist(), prompt, output + drafts[:j], repetition, frequency, presence
        )
        torch.testing.assert_close(got[j], torch.tensor(expected))


def test_position_counts_take_in_the_drafts_before_each_row() -> None:
    counts = position_counts([2, 2, 1], [1, 3], vocab=4)
    assert counts.tolist() == [[0, 1, 2, 0], [0, 2, 2, 0], [0, 2, 2, 1]]
    assert position_counts([], [], vocab=3).tolist() == [[0, 0, 0]]


def test_no_penalty_leaves_logits_alone() -> None:
    logits = torch.tensor([[1.0, -2.0, 0.5]])
    counts = torch.tensor([[1.0, 1.0, 0.0]])
    same = apply_penalties(logits, counts, torch.tensor([True, True, True]), 1.0, 0.0, 0.0)
    assert torch.equal(same, logits)
    assert not SamplingParams().penalized
    assert SamplingParams(presence_penalty=0.1).penalized


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("inf")},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -2.1},
    ],
)
def test_out_of_range_penalties_are_refused(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="penalty"):
        SamplingParams(**fields)  # type: ignore[arg-type]


def test_logit_bias_and_min_tokens_row_by_row() -> None:
    """Row j follows the output and j drafts: with two output tokens and min_tokens 4, rows
    0 and 1 (the 3rd and 4th tokens) cannot end the text, rows 2 and 3 can."""
    logits = torch.zeros(4, 8)
    params = SamplingParams(
        max_tokens=10, min_tokens=4, stop_token_ids=(5,), logit_bias=((1, 2.5), (6, -100.0))
    )
    assert params.adjusts_logits and not params.penalized
    got = params.adjust(logits, [0], [2, 3], [4, 4, 4], eos_token_ids=[7])
    assert got[:, 1].tolist() == [2.5] * 4 and got[:, 6].tolist() == [-100.0] * 4
    assert got[:2, 5].tolist() == got[:2, 7].tolist() == [float("-inf")] * 2
    assert got[2:, 5].tolist() == got[2:, 7].tolist() == [0.0] * 2
    assert logits.eq(0).all()  # the forward's logits are left alone
    keep_eos = replace(params, ignore_eos=True).adjust(logits, [0], [2, 3], [4, 4, 4], [7])
    assert keep_eos[:2, 5].tolist() == [float("-inf")] * 2 and keep_eos[:, 7].eq(0).all()
    done = params.adjust(logits, [0], [2, 3, 3, 3], [4], [7])
    assert done[:, 5].eq(0).all() and done[:, 7].eq(0).all()


def test_allowed_tokens_and_bad_words_row_by_row() -> None:
    """Only the allowed tokens stay; a one-token bad word is ruled out everywhere, a longer one
    only in the rows whose output so far (drafts before the row included) ends with the rest
    of it."""
    logits = torch.zeros(4, 8)
    inf = float("-inf")
    allowed = SamplingParams(allowed_token_ids=(2, 5)).adjust(logits, [0], [1], [2, 2, 2])
    assert allowed.isfinite().nonzero()[:, 1].tolist() == [2, 5] * 4
    params = SamplingParams(bad_words=((6,), (3, 4, 7)))
    assert params.adjusts_logits
    # Output [1, 3], drafts [4, 2, 3]: row 1 follows [1, 3, 4], so 7 would complete 3 4 7.
    got = params.adjust(logits, [0], [1, 3], [4, 2, 3])
    assert got[:, 6].tolist() == [inf] * 4
    assert got[:, 7].tolist() == [0.0, inf, 0.0, 0.0]
    assert got.isfinite().sum() == 4 * 8 - 5
    ends = params.adjust(logits[:1], [0], [3, 4], [])  # the output alone ends with 3 4
    assert ends[0, 7] == inf


@pytest.mark.parametrize(
    "fields",
    [{"logit_bias": ((3, 100.5),)}, {"min_tokens": 5, "max_tokens": 4}, {"min_tokens": -1}],
)
def test_out_of_range_bias_and_min_tokens_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"logit_bias|min_tokens"):
        SamplingParams(**fields)  # type: ignore[arg-type]


def test_penalty_rows_kept_across_steps_equal_counts_made_afresh() -> None:
    """A sequence's penalty row, brought up to date step by step (and counted again should its
    output ever be shorter than what was counted), adjusts logits exactly as counting the whole
    output again does."""
    from workers.engine.penalty_rows import PenaltyRows
    from workers.engine.sequence import Sequence
    from workers.kv_cache import BlockAllocator, BlockTable

    params = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.3)
    gen = torch.Generator().manual_seed(0)
    vocab, prompt = 40, [3, 7, 7, 11]
    rows = PenaltyRows(vocab, torch.device("cpu"))
    table = BlockTable(BlockAllocator(1), 16)
    seq = Sequence("s", prompt, params, "none", 0, table, None, 0)
    for step in range(12):
        if step == 8:  # shorter than counted: counted again
            del seq.token_ids[len(prompt) + 5 :]
        seq.token_ids += torch.randint(
            vocab, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen
        ).tolist()
        drafts = torch.randint(vocab, (3,), generator=gen).tolist()
        logits = torch.randn(4, vocab, generator=gen)
        kept = rows.apply(logits[None], [seq], [drafts])[0]
        fresh = params.adjust(logits, prompt, seq.output_token_ids, drafts)
        assert torch.equal(kept, fresh), step


def test_penalty_rows_give_each_sequence_what_adjust_gives_it_alone() -> None:
    """A step's penalties applied to all its sequences at once (workers/engine/penalty_rows.py):
    different penalties (some off), drafts of different lengths padded to one width, output
    growing across steps, finished sequences' rows reused, the rows grown and the batch in
    another order: every real row bit for bit what `adjust` gives that sequence alone."""
    from workers.engine.penalty_rows import PenaltyRows
    from workers.engine.sequence import Sequence
    from workers.kv_cache import BlockAllocator, BlockTable

    gen = torch.Generator().manual_seed(0)
    vocab = 50
    kinds = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=1.5, presence_penalty=2.0),
    ]
    rows = PenaltyRows(vocab, torch.device("cpu"))
    allocator = BlockAllocator(4)

    def new_seq(n: int) -> Sequence:
        prompt = torch.randint(vocab, (int(torch.randint(1, 9, (1,), generator=gen)),))
        return Sequence(
            f"s{n}", prompt.tolist(), kinds[n % 3], "none", 0, BlockTable(allocator, 16), None, n
        )

    seqs = [new_seq(n) for n in range(6)]
    made = len(seqs)
    for step in range(10):
        if step in (3, 6):  # two finish; new ones take their rows, and more (the rows grow)
            for seq in seqs[:2]:
                rows.release(seq.request_id)
            seqs = seqs[2:] + [new_seq(made + n) for n in range(4 if step == 3 else 2)]
            made += 4 if step == 3 else 2
        if step == 8:  # the same sequences in another order, none released: rows made again
            seqs = seqs[::-1]
        for seq in seqs:
            seq.token_ids += torch.randint(vocab, (step % 3,), generator=gen).tolist()
        drafts = [torch.randint(vocab, (n % 4,), generator=gen).tolist() for n in range(len(seqs))]
        width = 1 + max(len(d) for d in drafts)
        logits = torch.randn(len(seqs), width, vocab, generator=gen) * 3
        got = rows.apply(logits, seqs, drafts)
        for n, (seq, ids) in enumerate(zip(seqs, drafts, strict=True)):
            alone = seq.params.adjust(
                logits[n, : len(ids) + 1], seq.prompt_token_ids, seq.output_token_ids, ids
            )
            assert torch.equal(got[n, : len(ids) + 1], alone), (step, n)
    assert len(rows) == len(seqs)
