"""The EAGLE head and drafter on a tiny random target: drafting over the paged cache computes
exactly what training unrolls, features are tracked by position, files round-trip."""

from __future__ import annotations

import pytest
import torch

from tests.factories import tiny_eagle_head, tiny_model
from tests.unit.helpers import draft_ends_where_its_probability_falls_below_the_bar
from workers.drafting.base import Draft, DraftRequest
from workers.drafting.eagle import EagleDrafter
from workers.drafting.ngram import NgramConfig
from workers.eagle.data import EagleData, draft_vocabulary, teacher_force
from workers.eagle.head import EagleHead
from workers.eagle.layout import head_metadata, load_head, save_head
from workers.eagle.self_instruct import keep_turn
from workers.eagle.train import acceptance, batch_loss, feature_scales, fold_feature_scales, scaled
from workers.eagle.trees import (
    acceptance_length,
    acceptance_ranks,
    best_tree,
    chain,
    level_widths,
    walk,
)
from workers.eagle.unroll import make_batch, unrolled_outputs
from workers.engine.sampling_params import SamplingParams
from workers.model.transformer import TransformerLM

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def target() -> TransformerLM:
    return tiny_model(seed=3)


def features_for(target: TransformerLM, head: EagleHead, n: int, seed: int = 1) -> torch.Tensor:
    width = len(head.config.target_layers) * target.config.hidden_size
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("context", [1, 5, 11])
def test_drafting_matches_the_unrolled_training_forward(target, context: int) -> None:  # type: ignore[no-untyped-def]
    head = tiny_eagle_head(target)
    drafter = EagleDrafter(head, target, num_blocks=32, block_size=4)
    tokens = torch.randint(0, 97, (context + 1,), generator=torch.Generator().manual_seed(2))
    features = features_for(target, head, context)
    drafter.add("a", tokens.tolist(), GREEDY)
    drafter.observe_hidden("a", 0, features)
    k = 4
    draft = drafter.propose([DraftRequest("a", context + 1, k)])["a"]
    assert len(draft.token_ids) == k
    # Training's view: the drafts as if they were the true continuation.
    seq = tokens.tolist() + draft.token_ids
    t = len(seq) - 1
    next_tokens = torch.tensor(seq[1:]).unsqueeze(0)
    padded = torch.zeros(1, t, features.shape[1])
    padded[0, :context] = features
    with torch.no_grad():
        logits = [head.draft_logits(a) for a in unrolled_outputs(head, next_tokens, padded, k)]
    for j in range(k):
        row = context - 1 + j  # chain start context - 1, j-th draft
        assert int(head.draft_vocab[logits[j][0, row].argmax()]) == draft.token_ids[j]


def test_drafts_resume_after_commits_and_roll_back_draft_rows(target) -> None:  # type: ignore[no-untyped-def]
    head = tiny_eagle_head(target)
    drafter = EagleDrafter(head, target, num_blocks=32, block_size=4)
    prompt = list(range(10, 20))
    features = features_for(target, head, 20)
    drafter.add("a", prompt, GREEDY)
    drafter.observe_hidden("a", 0, features[:9])
    first = drafter.propose([DraftRequest("a", 10, 3)])["a"].token_ids
    # The verifier accepts one draft and adds a token: features for positions 9 and 10 arrive.
    drafter.observe_hidden("a", 9, features[9:11])
    drafter.commit("a", [first[0], 42])
    second = drafter.propose([DraftRequest("a", 12, 3)])["a"].token_ids
    # A fresh drafter told everything at once drafts the same.
    fresh = EagleDrafter(head, target, num_blocks=32, block_size=4)
    fresh.add("b", [*prompt, first[0], 42], GREEDY)
    fresh.observe_hidden("b", 0, features[:11])
    assert fresh.propose([DraftRequest("b", 12, 3)])["b"].token_ids == second
    # Proposing again with nothing new committed redoes the same rows.
    assert drafter.propose([DraftRequest("a", 12, 3)])["a"].token_ids == second


def test_drafting_is_timed_for_one_sequence_and_a_further_one(target) -> None:  # type: ignore[no-untyped-def]
    """`token_seconds`: one sequence's draft token, and what each further sequence drafting
    at once adds (`row_seconds`), which the speculator prices each depth's rows with; the
    calibration sequences are gone after."""
    drafter = EagleDrafter(tiny_eagle_head(target), target, num_blocks=64, block_size=4)
    assert drafter.row_seconds is None
    one = drafter.token_seconds(context=8, reps=2, rows=3)
    assert one > 0 and drafter.row_seconds is not None and drafter.row_seconds >= 0
    assert not drafter._seqs and drafter.allocator.num_free_blocks == 64


def test_features_are_tracked_by_position(target) -> None:  # type: ignore[no-untyped-def]
    head = tiny_eagle_head(target)
    drafter = EagleDrafter(head, target, num_blocks=32, block_size=4)
    features = features_for(target, head, 12)
    drafter.add("a", list(range(13)), GREEDY)
    drafter.observe_hidden("a", 0, features[:8])
    drafter.observe_hidden("a", 4, features[4:12])  # recomputed after preemption: overlap
    seq = drafter._seqs["a"]
    assert seq.features_end == 12
    assert sum(p.shape[0] for p in seq.pending) == 12
    ref = EagleDrafter(head, target, num_blocks=32, block_size=4)
    ref.add("a", list(range(13)), GREEDY)
    ref.observe_hidden("a", 0, features)
    request = [DraftRequest("a", 13, 2)]
    assert drafter.propose(request)["a"].token_ids == ref.propose(request)["a"].token_ids
    # A prompt whose start came from the prefix cache: features begin later, drafting works.
    late = EagleDrafter(head, target, num_blocks=32, block_size=4)
    late.add("c", list(range(13)), GREEDY)
    late.observe_hidden("c", 8, features[8:12])
    assert len(late.propose(request_for("c", 13, 2))["c"].token_ids) == 2
    # Missing the last position's feature: no draft rather than a wrong one.
    short = EagleDrafter(head, target, num_blocks=32, block_size=4)
    short.add("d", list(range(13)), GREEDY)
    short.observe_hidden("d", 0, features[:10])
    assert short.propose(request_for("d", 13, 2))["d"].token_ids == []


def test_prompt_lookup_drafts_where_the_text_repeats_and_the_head_elsewhere(target) -> None:  # type: ignore[no-untyped-def]
    head = tiny_eagle_head(target)
    lookup = EagleDrafter(head, target, num_blocks=32, block_size=4, lookup=NgramConfig(2, 4))
    plain = EagleDrafter(head, target, num_blocks=32, block_size=4)
    repeating = [7, 1, 2, 3, 4, 9, 8, 1, 2, 3]  # "1 2 3" came before, followed by 4 9 8
    fresh = list(range(20, 30))
    features = features_for(target, head, 9)
    for d in (lookup, plain):
        d.add("r", repeating, GREEDY)
        d.add("f", fresh, GREEDY)
        for rid in ("r", "f"):
            d.observe_hidden(rid, 0, features)
    # The speculator prices the looked-up draft at nothing: no head forward makes it.
    assert lookup.drafts_for_free("r") and not lookup.drafts_for_free("f")
    assert not plain.drafts_for_free("r")
    requests = [DraftRequest("r", 10, 3), DraftRequest("f", 10, 3)]
    got, head_only = lookup.propose(requests), plain.propose(requests)
    assert got["r"].token_ids == [4, 9, 8]
    assert got["f"] == head_only["f"]  # nothing repeats: the head drafts, as without lookup
    assert lookup.looked_up == 1
    # The head's cache was left alone for "r": it drafts right once the text stops repeating.
    for d in (lookup, plain):
        d.observe_hidden("r", 9, features_for(target, head, 1, seed=5))
        d.commit("r", [5])
    request = [DraftRequest("r", 11, 2)]
    assert lookup.propose(request)["r"].token_ids == plain.propose(request)["r"].token_ids
    # A sampled request's looked-up draft is deterministic: q is one-hot (probs None).
    lookup.add("s", repeating, SamplingParams(temperature=0.8, seed=1))
    lookup.observe_hidden("s", 0, features)
    assert lookup.propose([DraftRequest("s", 10, 2)])["s"] == Draft([4, 9])


def request_for(rid: str, num_tokens: int, k: int) -> list[DraftRequest]:
    return [DraftRequest(rid, num_tokens, k)]


def test_sampled_drafts_return_q_over_the_draft_vocabulary(target) -> None:  # type: ignore[no-untyped-def]
    head = tiny_eagle_head(target)
    drafter = EagleDrafter(head, target, num_blocks=32, block_size=4)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    drafter.add("a", list(range(6)), params)
    drafter.observe_hidden("a", 0, features_for(target, head, 5))
    draft = drafter.propose([DraftRequest("a", 6, 3)])["a"]
    assert draft.probs is not None and draft.probs.shape == (3, 97)
    assert torch.allclose(draft.probs.sum(-1), torch.ones(3))
    outside = torch.ones(97, dtype=torch.bool)
    outside[head.draft_vocab] = False
    assert float(draft.probs[:, outside].sum()) == 0.0
    for token, row in zip(draft.token_ids, draft.probs, strict=True):
        assert row[token] > 0


def test_a_head_draft_ends_where_the_head_doubts_it(target) -> None:  # type: ignore[no-untyped-def]
    head = tiny_eagle_head(target)
    features = features_for(target, head, 5)
    draft_ends_where_its_probability_falls_below_the_bar(
        lambda bar: EagleDrafter(head, target, num_blocks=32, block_size=4, min_confidence=bar),
        list(range(6)),
        lambda drafter: drafter.observe_hidden("a", 0, features),
    )


def test_out_of_cache_blocks_gives_an_empty_draft_and_recovers(target) -> None:  # type: ignore[no-untyped-def]
    head = tiny_eagle_head(target)
    drafter = EagleDrafter(head, target, num_blocks=2, block_size=4)
    features = features_for(target, head, 20)
    drafter.add("a", list(range(21)), GREEDY)
    drafter.observe_hidden("a", 0, features)
    assert drafter.propose([DraftRequest("a", 21, 2)])["a"].token_ids == []
    drafter.remove("a")
    assert drafter.allocator.num_free_blocks == 2


def test_head_file_round_trip(target, tmp_path) -> None:  # type: ignore[no-untyped-def]
    head = tiny_eagle_head(target)
    path = tmp_path / "head.safetensors"
    save_head(head, path, {"command": "python -m workers.eagle.train --seed 0"})
    loaded = load_head(path)
    assert loaded.config == head.config
    assert torch.equal(loaded.draft_vocab, head.draft_vocab)
    assert torch.equal(loaded.fc.weight, head.fc.weight)
    assert head_metadata(path)["command"].startswith("python -m workers.eagle.train")
    (tmp_path / "bad.safetensors").write_bytes(b"not a head")
    with pytest.raises(Exception):  # noqa: B017 (safetensors' own error type)
        load_head(tmp_path / "bad.safetensors")


def tiny_data(target: TransformerLM, head: EagleHead, seqs: int = 3, length: int = 12) -> EagleData:
    gen = torch.Generator().manual_seed(7)
    n = seqs * length
    logits = torch.randn(n, target.config.vocab_size, generator=gen)
    top = torch.log_softmax(logits, -1).topk(16, dim=-1)
    return EagleData(
        token_ids=torch.randint(0, 97, (n,), generator=gen),
        offsets=torch.arange(0, n + 1, length),
        prompt_lens=torch.full((seqs,), 4),
        features=features_for(target, head, n).bfloat16(),
        top_ids=top.indices,
        top_logprobs=top.values,
        target_layers=head.config.target_layers,
    )


def test_training_loss_falls_and_acceptance_is_measured(target) -> None:  # type: ignore[no-untyped-def]
    head = tiny_eagle_head(target, draft_vocab=97)
    head.init_weights(0)
    data = tiny_data(target, head)
    to_draft = torch.full((97,), -1, dtype=torch.int64)
    to_draft[head.draft_vocab] = torch.arange(97)
    batch = make_batch(data, [0, 1, 2], to_draft)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    # The soft labels' own entropy is the floor: the loss must close most of the gap to it.
    p = batch.label_probs
    floor = float(-(p * p.clamp(min=1e-30).log()).sum(-1)[batch.row_weight > 0].mean())
    losses = []
    for _ in range(60):
        loss, stats = batch_loss(head, batch, depth=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] - floor < 0.5 * (losses[0] - floor)
    rates, mean_len = acceptance([stats], depth=3)
    assert all(0.0 <= r <= 1.0 for r in rates)
    assert 1.0 <= mean_len <= 4.0


def test_a_head_trained_on_scaled_features_reads_them_raw_once_folded(target) -> None:  # type: ignore[no-untyped-def]
    head = tiny_eagle_head(target, draft_vocab=97)
    head.init_weights(0)
    data = tiny_data(target, head)
    h = target.config.hidden_size
    layer_gain = torch.tensor([1.0, 10.0, 40.0][: len(head.config.target_layers)])
    data.features = data.features * layer_gain.repeat_interleave(h)
    scales = feature_scales(data, len(head.config.target_layers))
    per_layer = scales.unflatten(0, (-1, h))
    assert torch.equal(per_layer, per_layer[:, :1].expand_as(per_layer))  # one scale a layer
    ratio = per_layer[:, 0] / per_layer[0, 0]
    torch.testing.assert_close(ratio, layer_gain / layer_gain[0], rtol=0.3, atol=0.0)
    to_draft = torch.full((97,), -1, dtype=torch.int64)
    to_draft[head.draft_vocab] = torch.arange(97)
    with torch.no_grad():
        trained = unrolled_outputs(head, *_rows(scaled(make_batch(data, [0, 1], to_draft), scales)))
        fold_feature_scales(head, scales)
        served = unrolled_outputs(head, *_rows(make_batch(data, [0, 1], to_draft)))
    for a, b in zip(trained, served, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _rows(batch):  # type: ignore[no-untyped-def]
    return batch.next_tokens, batch.features.float(), 3


def test_draft_vocabulary_keeps_the_most_predicted_tokens(target) -> None:  # type: ignore[no-untyped-def]
    head = tiny_eagle_head(target)
    data = tiny_data(target, head)
    data.top_ids[:, 0] = torch.tensor([5, 5, 5, 9, 9, 2] * 6)
    assert draft_vocabulary(data, 3).tolist() == [2, 5, 9]


def test_data_of_two_sources_joins_sequence_by_sequence(target) -> None:  # type: ignore[no-untyped-def]
    head = tiny_eagle_head(target)
    a, b = tiny_data(target, head, seqs=3, length=12), tiny_data(target, head, seqs=2, length=5)
    joined = EagleData.concat([a, b])
    assert joined.num_sequences == 5
    for s in range(5):
        part, t = (a, s) if s < 3 else (b, s - 3)
        assert torch.equal(joined.token_ids[joined.sequence(s)], part.token_ids[part.sequence(t)])
        assert torch.equal(joined.features[joined.sequence(s)], part.features[part.sequence(t)])
        assert joined.prompt_lens[s] == part.prompt_lens[t]
    other = tiny_data(target, head)
    other.target_layers = (0,)
    with pytest.raises(ValueError, match="target layers"):
        EagleData.concat([a, other])


def test_tree_acceptance_follows_the_ranks_of_the_target_tokens() -> None:
    ranks = torch.tensor([[0, 0, 0], [1, 0, 5], [0, 2, 0], [9, 0, 0]])
    assert acceptance_length(chain(3), ranks) == (4 + 1 + 2 + 1) / 4
    tree = best_tree(ranks, 3)
    assert tree == [(0,), (1,), (0, 0)]  # (0,) twice; then ties: parents, lower ranks first
    assert acceptance_length(tree, ranks) == (3 + 2 + 2 + 1) / 4
    assert level_widths(tree) == [2, 1]
    big = best_tree(ranks, 50)
    assert all(len(p) == 1 or p[:-1] in big for p in big)
    assert not any(9 in p for p in big)  # beyond max_rank: never drafted


def test_walking_a_sequence_starts_each_step_where_the_last_ended() -> None:
    # Chains at consecutive starts of one answer.
    ranks = torch.tensor([[0, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0], [2, 0, 0], [0, 0, 1]])
    # Start 0 accepts 1 (2 tokens), start 2 none (1), start 3 all three (4), then past the end.
    assert walk(chain(3), ranks) == (7, 3)
    assert acceptance_length(chain(3), ranks) == 1 + (1 + 3 + 0 + 3 + 0 + 2) / 6
    # A tree holding rank path (1,) too accepts start 2's second candidate: 2 tokens, then
    # start 4 (none accepted), start 5 (two).
    assert walk([(0,), (1,), (0, 0)], ranks) == (2 + 2 + 1 + 3, 4)


def test_chain_acceptance_from_ranks_matches_the_training_measure(target) -> None:  # type: ignore[no-untyped-def]
    head = tiny_eagle_head(target, draft_vocab=97)
    data = tiny_data(target, head, seqs=3, length=16)
    to_draft = torch.arange(97)
    ranks = torch.cat(acceptance_ranks(head, data, 3, vocab_size=97))
    with torch.no_grad():
        _, stats = batch_loss(head, make_batch(data, [0, 1, 2], to_draft), depth=3)
    _, mean_len = acceptance([stats], depth=3)
    assert acceptance_length(chain(3), ranks) == pytest.approx(mean_len)
    assert len(ranks) == 3 * (16 - 1 - 3 - 2)  # rows 3..14 answer rows, 10 chains fit


def test_self_instruct_keeps_finished_english_turns_far_from_held_out_prompts() -> None:
    held_out = ["Can you explain how airplanes stay in the air?"]
    assert keep_turn("How do I plan a week of cheap dinners?", True, held_out)
    assert not keep_turn("How do I plan a week of cheap dinners?", False, held_out)  # cut off
    assert not keep_turn("Hi there", True, held_out)  # too short
    assert not keep_turn("富僽香設 永丹有一封勋工 称不远怒", True, held_out)
    assert not keep_turn("Please explain how airplanes stay up in the air.", True, held_out)


def test_drafting_ahead_serves_a_right_guess_and_drops_a_wrong_one(target) -> None:  # type: ignore[no-untyped-def]
    head = tiny_eagle_head(target)
    features = features_for(target, head, 24)
    prompt = list(range(10, 20))
    drafter = EagleDrafter(head, target, num_blocks=32, block_size=4)
    longer = EagleDrafter(head, target, num_blocks=32, block_size=4)
    for d in (drafter, longer):
        d.add("a", prompt, GREEDY)
        d.observe_hidden("a", 0, features[:9])
    draft = drafter.propose(request_for("a", 10, 3))["a"].token_ids
    drafter.draft_ahead(request_for("a", 10, 3))
    # Drafting ahead runs on the head's own features, so the guess and the draft after it are
    # what one draft of 2k + 1 tokens holds.
    whole = longer.propose(request_for("a", 10, 7))["a"].token_ids
    assert draft == whole[:3]
    seq = drafter._seqs["a"]
    assert seq.ahead.guess == whole[:4] and seq.ahead.prepared is not None
    assert seq.ahead.prepared.token_ids == whole[4:]

    # The verifier accepted the draft and its bonus token was the guess: served as prepared.
    drafter.observe_hidden("a", 9, features[9:13])
    drafter.commit("a", whole[:4])
    assert drafter.propose(request_for("a", 14, 3))["a"].token_ids == whole[4:]
    assert (drafter.ahead_prepared, drafter.ahead_served) == (1, 1)
    # Drafting ahead again uses the target's features that came meanwhile; a wrong guess is
    # dropped and the proposal equals a fresh drafter's that was told everything.
    drafter.draft_ahead(request_for("a", 14, 3))
    drafter.observe_hidden("a", 13, features[13:15])
    wrong = [whole[4], 42 if whole[5] != 42 else 43]
    drafter.commit("a", wrong)
    fresh = EagleDrafter(head, target, num_blocks=32, block_size=4)
    fresh.add("b", prompt + whole[:5] + wrong[1:], GREEDY)
    fresh.observe_hidden("b", 0, features[:15])
    got = drafter.propose(request_for("a", 16, 3))["a"].token_ids
    assert got == fresh.propose(request_for("b", 16, 3))["b"].token_ids
    assert (drafter.ahead_prepared, drafter.ahead_served) == (2, 1)


def test_teacher_force_packs_sequences_without_changing_the_data(target) -> None:  # type: ignore[no-untyped-def]
    """Sequences that share a forward get what each got from a forward of its own."""
    gen = torch.Generator().manual_seed(3)
    lengths = [(5, 7), (20, 30), (3, 2), (40, 10), (9, 9)]
    seqs = [
        (
            torch.randint(0, 97, (p,), generator=gen).tolist(),
            torch.randint(0, 97, (a,), generator=gen).tolist(),
        )
        for p, a in lengths
    ]
    layers = (0, 1)
    alone = teacher_force(target, seqs, layers, progress=False, tokens_per_forward=16)
    packed = teacher_force(target, seqs, layers, progress=False, tokens_per_forward=1024)
    assert packed.offsets.tolist() == alone.offsets.tolist() == [0, 12, 62, 67, 117, 135]
    assert packed.prompt_lens.tolist() == [p for p, _ in lengths]
    assert torch.equal(packed.token_ids, torch.tensor([t for p, a in seqs for t in p + a]))
    assert torch.equal(packed.token_ids, alone.token_ids)
    assert packed.features.shape == (135, 2 * target.config.hidden_size)
    torch.testing.assert_close(
        packed.features.float(), alone.features.float(), atol=2e-2, rtol=2e-2
    )
    torch.testing.assert_close(packed.top_logprobs, alone.top_logprobs, atol=1e-4, rtol=1e-4)
    assert torch.equal(packed.top_ids, alone.top_ids)
