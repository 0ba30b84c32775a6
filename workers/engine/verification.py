"""From the logits of a forward to the tokens each sequence commits (rejection sampling)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.rejection import PLACEHOLDER_TOKEN_ID, greedy_accept, rejection_sample
from workers.engine.model_runner import RunnerOutput
from workers.engine.penalty_rows import PenaltyRows
from workers.engine.sampler import Sampler
from workers.engine.scheduler import ScheduledSeq
from workers.engine.sequence import Sequence as Sequence_
from workers.engine.tree_verification import verify_tree


@dataclass(frozen=True, slots=True)
class Failed:
    """A sequence whose own part of verification raised (its grammar, say): it commits
    nothing and ends alone, while the others in the batch commit as usual."""

    error: Exception


@dataclass(frozen=True, slots=True)
class DeadEnd:
    """A sequence whose own settings rule out every token at its next position
    (`allowed_token_ids`, and a bad word that ends in each of them): nothing may come next,
    so its answer ends there (finish reason "stop"), as one whose grammar is complete does."""


def is_dead(logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab] -> [rows] bool
    """Rows whose every token the request's settings put at -inf."""
    return torch.isneginf(logits.amax(dim=-1))


def verify(
    batch: Sequence[ScheduledSeq],
    output: RunnerOutput,
    sampler: Sampler,
    penalties: PenaltyRows,
) -> list[list[int] | Failed | DeadEnd | None]:
    """Committed tokens of each scheduled sequence (None for a prefill chunk that samples none,
    `Failed` for one whose penalties or grammar raised, `DeadEnd` for one that may take no
    token).

    A sequence without a draft simply samples one token (k = 0: the bonus token); one with a
    draft gets its accepted prefix plus a recovered or bonus token. Greedy rows are decided by
    the argmax of their logits alone; the rest go through the sampling transform and
    `rejection_sample` together. A request with penalties, a logit bias, `min_tokens` or a
    grammar has them applied to each row first, the row's output taking in the drafts before
    it: penalties for all such sequences at once (`penalties`, workers/engine/penalty_rows.py),
    the rest per sequence. The sampled rows go to `sampler` together (workers/engine/sampler.py:
    on the host, or on the forward's device). A sequence's sampling rows are its last k + 1 (a
    prompt chunk scored for its log-probabilities has every position's row before them). A row
    whose settings leave no token is never committed from: the tokens before it are, and the
    next step, starting at that row, ends the sequence there (as plain decoding would).
    """
    committed: list[list[int] | Failed | DeadEnd | None] = [None] * len(batch)
    sampled: list[int] = []  # they need the target's probabilities
    adjusted: list[int] = []  # greedy, with their logits adjusted first
    # Greedy rows need only the argmax: one call and one copy to the host for the whole batch
    # (per row, a GPU step paid a launch and a sync for each sequence).
    argmax: list[int] | None = None
    ends = [end for _, end in output.logits_spans]
    for i, s in enumerate(batch):
        if not (s.decoding or s.samples):
            continue
        draft_ids = s.draft.token_ids
        if (
            s.draft.parents is not None
        ):  # a tree: its own walk (workers/engine/tree_verification.py)
            assert not s.seq.adjusts_logits, "a request that adjusts logits drafts no tree"
            committed[i], s.path = verify_tree(
                draft_ids, s.draft.parents, s.seq.params, output.logits_of(i), s.seq.generator
            )
        elif not s.seq.params.greedy:
            sampled.append(i)
        elif s.seq.adjusts_logits:
            adjusted.append(i)
        else:  # the argmax decides: no transform, no probabilities
            if argmax is None:
                argmax = output.output.logits.argmax(dim=-1).tolist()
            end = ends[i]
            if draft_ids:
                committed[i] = greedy_accept(draft_ids, argmax[end - len(draft_ids) - 1 : end])
            else:
                committed[i] = [argmax[end - 1]]
    all_logits = output.output.logits
    if adjusted:
        logits, dead = _adjusted_rows(batch, adjusted, output, all_logits.device, penalties)
        best = logits.argmax(dim=-1).tolist()  # [len(adjusted), width]
        for n, i in enumerate(adjusted):
            draft_ids = batch[i].draft.token_ids
            tokens = greedy_accept(draft_ids, best[n][: len(draft_ids) + 1])
            committed[i] = _after_adjustment(tokens, dead.get(i))
    if not sampled:
        return committed
    logits, dead = _adjusted_rows(batch, sampled, output, sampler.device_for(all_logits), penalties)
    tokens_of = sampler.sample(
        logits,
        [batch[i].draft.token_ids for i in sampled],
        [batch[i].draft.probs for i in sampled],
        [batch[i].seq for i in sampled],
    )
    for i, tokens in zip(sampled, tokens_of, strict=True):
        committed[i] = _after_adjustment(tokens, dead.get(i))
    return committed


def _after_adjustment(
    tokens: list[int], left: torch.Tensor | Failed | None
) -> list[int] | Failed | DeadEnd:
    """What a sequence commits of the tokens drawn from its adjusted rows, given what its
    adjustment left (`_adjusted_rows`): nothing but its failure, the tokens before its first
    row with no token, or all of them."""
    if isinstance(left, Failed):
        return left
    return tokens if left is None else _before_dead_end(tokens, left)


def _adjusted_rows(
    batch: Sequence[ScheduledSeq],
    chosen: list[int],
    output: RunnerOutput,
    device: torch.device,
    penalties: PenaltyRows,
) -> tuple[torch.Tensor, dict[int, torch.Tensor | Failed]]:
    """The chosen sequences' sampling rows as one `[len(chosen), max_k + 1, vocab]` fp32
    tensor on `device` (row n's k_n + 1 logits, padded by repeating its last, which nobody
    reads), adjusted by each sequence's settings: penalties for all at once, the rest one
    sequence at a time. Beside it, by batch index, what an adjustment left: the rows with no
    token left (`is_dead`, `[k + 1]` bool) of a sequence with a mask, or `Failed` where its own
    adjustment raised (its rows then hold a harmless distribution)."""
    ks = [len(batch[i].draft.token_ids) for i in chosen]
    max_k = max(ks)
    all_logits = output.output.logits
    vocab = all_logits.shape[-1]
    ends = [output.logits_spans[i][1] for i in chosen]
    index = [
        end - k - 1 + min(j, k) for end, k in zip(ends, ks, strict=True) for j in range(max_k + 1)
    ]
    logits = (
        all_logits.index_select(0, torch.tensor(index, device=all_logits.device))
        .to(device, torch.float32)
        .view(len(chosen), max_k + 1, vocab)
    )
    seqs = [batch[i].seq for i in chosen]
    penalized = [n for n, seq in enumerate(seqs) if seq.params.penalized]
    if len(penalized) == len(chosen):
        logits = penalties.apply(logits, seqs, [batch[i].draft.token_ids for i in chosen])
    elif penalized:
        rows = torch.tensor(penalized, device=device)
        logits[rows] = penalties.apply(
            logits[rows],
            [seqs[n] for n in penalized],
            [batch[chosen[n]].draft.token_ids for n in penalized],
        )
    left: dict[int, torch.Tensor | Failed] = {}
    for n, (i, k) in enumerate(zip(chosen, ks, strict=True)):
        seq = seqs[n]
        if not seq.params.adjusts_beyond_penalties:
            continue
        try:
            rows = _adjusted(seq, batch[i].draft.token_ids, logits[n, : k + 1], penalize=False)
        except Exception as exc:  # this sequence's own failure: the batch goes on
            left[i] = Failed(exc)
            logits[n] = 0.0  # whatever it left half-done, a harmless distribution
            continue
        left[i] = dead = is_dead(rows)
        rows[dead] = 0.0  # a harmless distribution, never committed from
        logits[n, : k + 1] = rows
    return logits, left


def _before_dead_end(tokens: list[int], dead: torch.Tensor) -> list[int] | DeadEnd:
    """The committed tokens (token j drawn from row j) before the first row that had no token
    to give, or `DeadEnd` when that is the first row."""
    first = next((j for j, row_dead in enumerate(dead[: len(tokens)].tolist()) if row_dead), None)
    if first is None:
        return tokens
    return tokens[:first] if first > 0 else DeadEnd()


def sampling_rows(output: RunnerOutput, index: int, scheduled: ScheduledSeq) -> torch.Tensor:
    """The rows of sequence `index` that its committed tokens were decided at: the last k + 1
    (they verify its k drafts and sample after them), or a tree's accepted path."""
    return kept_rows(output.logits_of(index), scheduled, len(scheduled.draft.token_ids) + 1, True)


def kept_rows(
    rows: torch.Tensor, scheduled: ScheduledSeq, count: int, from_end: bool = False
) -> torch.Tensor:
    """Of a sequence's rows in a forward, those of the positions it keeps: `count` of them (the
    first, or the last `from_end`), or a draft tree's accepted path."""
    if scheduled.path is not None:
        return rows.index_select(0, torch.tensor(scheduled.path, device=rows.device))
    return rows[rows.shape[0] - count :] if from_end else rows[:count]


def sample_one(seq: Sequence_, logits: torch.Tensor) -> int | DeadEnd:
    """The token a forward with these last-position logits (`[vocab]`) would commit for `seq`
    without a draft: the same transform and the same draw from the sequence's generator as
    `verify` makes for a row with k = 0; `DeadEnd` where its settings leave no token."""
    p = seq.params
    if p.adjusts_logits:
        logits = _adjusted(seq, (), logits.view(1, -1))[0]
        if bool(is_dead(logits.view(1, -1))):
            return DeadEnd()
    if p.greedy:
        return int(logits.argmax())
    probs = p.probs(logits).view(1, 1, -1)
    drafts = torch.full((1, 0), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
    sampled = rejection_sample(drafts, [0], [None], probs, [p.greedy], [seq.generator])
    return int(sampled[0, 0])


def _adjusted(
    seq: Sequence_, draft_ids: Sequence[int], logits: torch.Tensor, penalize: bool = True
) -> torch.Tensor:
    """The request's penalties (unless `penalize` is False: applied already), bias,
    `min_tokens` and grammar on its rows' logits (`[len(draft_ids) + 1, vocab]`)."""
    return seq.params.adjust(
        logits,
        seq.prompt_token_ids,
        seq.output_token_ids,
        draft_ids,
        seq.eos_token_ids,
        seq.grammar,
        penalize=penalize,
    )
