"""Drafting with an EAGLE head (workers/eagle/head.py) fed by the target's hidden states.

For each sequence the drafter holds the target features it was sent (`observe_hidden`, one row
per verified position) and the committed tokens, and keeps the head's own one-layer paged KV
cache: row r holds the head's input for position base + r (the target feature there plus the
token after it), where `base` is the first position it has a feature for (later than 0 when the
verifier reused a cached prompt prefix and never recomputed its start; rotary attention only
sees relative positions, so rows are indexed from 0 without loss). A sequence's state and its
cache's bookkeeping are workers/drafting/eagle_seq.py's.

A proposal first rolls the cache back to the rows made from target features (the previous
draft's rows go), feeds the rows for newly verified positions in one batched forward (their
last output drafts the first token), then drafts one token per forward, batched over sequences,
with the head's own output standing in for the target feature. Drafts follow the same
temperature/top-k/top-p/min-p transform as the target, and q is returned for rejection sampling;
tokens outside the draft vocabulary have q = 0. A draft ends early once the head's probability
of it falls below `min_confidence` (base.py `ConfidenceStop`). With a draft loop
(workers/drafting/eagle_loop.py, CUDA graphs on a GPU), greedy proposals without forced tokens
or a grammar are drafted there instead, in one replay; a sequence with more than k + 1 new
feature rows (a prompt's, or those of steps prompt lookup drafted) first has all but the last
fed to the head's cache in one eager forward (`_catch_up`).

With `lookup` set, a sequence whose text ends in an n-gram that occurred before is drafted by
prompt lookup instead (what followed the n-gram there; q one-hot) and the head does not run for
it: its unread features stay pending and go into the cache with its next head draft. A request
with a predicted output (OpenAI's Predicted Outputs, ngram.py `Prediction`) is drafted from it
first, lookup or not.

Drafting ahead (base.py) redoes the last proposal's rows (the tokens are given, not drawn), then
draws the bonus-token guess and k more, all from the head's own features: the target's features
for those positions exist only after the verify step being waited for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.attention import AttentionBackend, NativeCpuAttention
from kernels.attention_uniform import select_uniform_backend
from kernels.sampling import sample_from_probs
from workers.drafting import eagle_timing
from workers.drafting.ahead import DraftsAhead
from workers.drafting.base import (
    EMPTY_DRAFT,
    ConfidenceStop,
    Draft,
    DraftRequest,
    check_view,
    draft_random,
    greedy_probability,
)
from workers.drafting.eagle_loop import EagleDraftLoop, LoopConfig
from workers.drafting.eagle_seq import EagleSeq
from workers.drafting.eagle_tree import BRANCH, TreeDrafter
from workers.drafting.eagle_tree_loop import EagleTreeLoop
from workers.drafting.ngram import LookupIndex, NgramConfig, Prediction, prompt_lookup
from workers.eagle.head import EagleHead
from workers.engine.graph_runner import CaptureReport
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import Grammars, GrammarState
from workers.kv_cache import BlockAllocator, BlockTable, NoFreeBlocksError, PagedKVCache
from workers.model.transformer import TransformerLM

_DRAFT_SEED_OFFSET = 0xEA61E
# Features held for a sequence that is not drafting before the oldest are dropped.
MAX_PENDING_ROWS = 1024
# Tokens a lookup made ahead of a proposal keeps (a draft never asks for more).
LOOKUP_AHEAD = 16


@dataclass(slots=True)
class _Walk:
    """A grammar walked over one draft: how many tokens it read (to roll back)."""

    grammar: GrammarState
    read: int


class EagleDrafter(DraftsAhead):
    method = "eagle"

    def __init__(
        self,
        head: EagleHead,
        target: TransformerLM,
        num_blocks: int,
        block_size: int = 16,
        max_model_len: int = 0,
        attention: AttentionBackend | None = None,
        lookup: NgramConfig | None = None,
        min_confidence: float = 0.0,
        grammars: Grammars | None = None,
        loop: LoopConfig | None = None,
    ) -> None:
        head.config.check_target(target.config)
        head = head.to(device=target.device, dtype=target.dtype)
        head.attach(target)
        self.head = head
        self.hidden_layers = head.config.target_layers
        layer_config = head.config.layer_config()
        # With the draft loop, one block more than the allocator hands out: the scratch block
        # its padding writes into.
        self.cache = PagedKVCache(
            layer_config, num_blocks + (loop is not None), block_size, target.dtype, target.device
        )
        self.allocator = BlockAllocator(num_blocks)
        self.backend = attention or NativeCpuAttention()
        self.max_model_len = max_model_len or target.config.max_context
        self.loop = None if loop is None else self._make_loop(loop, num_blocks, min_confidence)
        self.tree_loop: EagleTreeLoop | None = None
        if loop is not None and loop.tree_nodes:  # trees drafted on the device too
            tree_loop = self._make_loop(loop, num_blocks, min_confidence, trees=True)
            assert isinstance(tree_loop, EagleTreeLoop)
            self.tree_loop = tree_loop
        self.vocab = head.draft_vocab.cpu()  # sampling is host work (per-request generators)
        self.full_vocab_size = target.config.vocab_size
        self._seqs: dict[str, EagleSeq] = {}
        # Prompt lookup first: where the text's last min_n..max_n tokens occurred before, what
        # followed them there is the draft, and the head does not run (None: the head always).
        self.lookup = lookup
        self.looked_up = 0  # proposals made by prompt lookup
        # A head draft ends once the head's probability of it falls below this (base.py).
        self.min_confidence = min_confidence
        # Requests with structured output get drafts their grammar allows (None: drafts ignore
        # grammars, and the target rejects what they break).
        self.grammars = grammars
        # Draft trees (workers/drafting/eagle_tree.py), for requests that ask for one.
        self.trees = TreeDrafter(head, self.cache, self.backend, self.vocab, self.max_model_len)
        self.drafts_trees = self.backend.serves_trees

    def _make_loop(
        self, config: LoopConfig, scratch_block: int, min_confidence: float, trees: bool = False
    ) -> EagleDraftLoop:
        """The chain's draft loop, or (`trees`) the tree's (workers/drafting/eagle_tree_loop.py)."""
        shape = self.head.config
        width = max(config.max_depth + 1, BRANCH if trees else 1)
        attention = config.attention or select_uniform_backend(
            self.cache.data.device,
            self.cache.data.dtype,
            shape.head_dim,
            shape.num_heads // shape.num_kv_heads,
            width,
        )
        head, layer, block_size = self.head, self.cache.layers[0], self.cache.block_size
        slot, seqs, depth = scratch_block * block_size, config.max_seqs, config.max_depth
        if trees:
            return EagleTreeLoop(
                head, layer, attention, block_size=block_size, scratch_slot=slot,
                max_seqs=seqs, max_depth=depth, max_rows=self.max_model_len,
            )  # fmt: skip
        return EagleDraftLoop(
            head, layer, attention, block_size=block_size, scratch_slot=slot, max_seqs=seqs,
            max_depth=depth, max_rows=self.max_model_len, min_confidence=min_confidence,
        )  # fmt: skip

    def capture(self) -> CaptureReport | None:
        """Capture the draft loops' CUDA graphs (None without a loop or a GPU)."""
        if self.loop is None or self.cache.data.device.type != "cuda":
            return None
        report = self.loop.capture()
        if self.tree_loop is None:
            return report
        trees = self.tree_loop.capture()
        return CaptureReport(
            report.num_graphs + trees.num_graphs,
            report.seconds + trees.seconds,
            report.memory_bytes + trees.memory_bytes,
        )

    # -- the Drafter boundary ------------------------------------------------------------------

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        table = BlockTable(self.allocator, self.cache.block_size)
        draws = draft_random(params, _DRAFT_SEED_OFFSET)
        grammar = None
        if params.structured is not None and self.grammars is not None:
            try:
                grammar = self.grammars.start(params.structured)
            except ValueError:  # the verifier refuses such a request itself
                grammar = None
        self._seqs[request_id] = EagleSeq(
            params,
            table,
            draws,
            list(prompt_token_ids),
            grammar=grammar,
            prediction=Prediction.of(params, len(prompt_token_ids)),
        )

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        """Chains as `DraftsAhead.propose` makes them; a request for a tree (`tree_nodes`)
        gets one from the head, unless prompt lookup or its predicted output drafts it (a
        chain, at no cost), and is never drafted ahead."""
        asks = [req for req in requests if req.tree_nodes > 0]
        if not asks:
            return super().propose(requests)
        drafts = super().propose([req for req in requests if req.tree_nodes == 0])
        trees = []
        for req in asks:
            seq = self._seqs[req.request_id]
            check_view(req, len(seq.tokens))
            seq.ahead.ready, seq.ahead.draft = None, []
            k = min(req.k, self.max_model_len - len(seq.tokens))
            drafts[req.request_id] = EMPTY_DRAFT
            if k <= 0 or not seq.can_draft:
                continue
            looked_up = self._draft([(req.request_id, seq, [], k)], lambda: True, lookup_only=True)
            if looked_up:
                drafts |= looked_up
            else:
                trees.append((req.request_id, seq, k, req.tree_nodes))
        loop = self.tree_loop
        if loop is not None and trees:
            done, taken = self._loop_takes(loop, [(rid, seq, k) for rid, seq, k, _ in trees])
            if looped := [t for t in trees if t[0] in taken]:
                done |= loop.propose_trees(looped)
            drafts |= done
            trees = [t for t in trees if t[0] not in done]
        return drafts | self.trees.propose(trees)

    def observe_hidden(self, request_id: str, first_position: int, hidden: torch.Tensor) -> None:
        seq = self._seqs[request_id]
        if seq.base is None or first_position > seq.features_end:
            # First features, or a gap: start the cache over from here.
            seq.reset()
            seq.base = seq.features_end = first_position
        skip = seq.features_end - first_position  # already seen (a recomputed prefix)
        if skip < hidden.shape[0]:  # from a link, they may arrive in host memory
            seq.pending.append(hidden[skip:].to(self.cache.data.device))
            seq.features_end += hidden.shape[0] - skip
        if seq.num_pending > MAX_PENDING_ROWS:
            # Not drafting for a long while (a large batch): keep only the recent context.
            recent = torch.cat(seq.pending)[-MAX_PENDING_ROWS // 2 :]
            end = seq.features_end
            seq.reset()
            seq.base, seq.features_end, seq.pending = end - recent.shape[0], end, [recent]

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        seq = self._seqs[request_id]
        seq.tokens.extend(token_ids)
        seq.ahead.committed(token_ids)
        if seq.grammar is not None:
            seq.grammar.advance(token_ids)

    def remove(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            seq.table.release()

    def drafts_for_free(self, request_id: str) -> bool:
        """Whether prompt lookup drafts the sequence's next proposal (the head does not run
        for it). A request with a predicted output is not looked at here: matching it moves
        its cursor."""
        seq = self._seqs.get(request_id)
        if seq is None or self.lookup is None or seq.prediction is not None:
            return False
        return bool(self._lookup(seq, seq.tokens))

    def _lookup(self, seq: EagleSeq, text: list[int]) -> list[int]:
        """Prompt lookup's continuation of `text` (up to LOOKUP_AHEAD tokens); the committed
        text's is kept until the next commit, so pricing a draft and making it look once."""
        assert self.lookup is not None
        committed = text is seq.tokens
        if committed and seq.looked_up is not None and seq.looked_up[0] == len(text):
            return seq.looked_up[1]
        low, high = self.lookup.min_n, self.lookup.max_n
        if not committed:  # with guessed tokens after the committed ones (drafting ahead)
            return prompt_lookup(text, LOOKUP_AHEAD, low, high)
        if seq.index is None:
            seq.index = LookupIndex(low, high)
        found = seq.index.find(text, LOOKUP_AHEAD, low, high)
        seq.looked_up = (len(text), found)
        return found

    def token_seconds(self, context: int = 128, reps: int = 10, rows: int = 1) -> float:
        """Median seconds to draft one token for one sequence after a `context`-row history;
        with `rows` > 1 also `row_seconds`, and with the draft loop `launch_seconds`
        (workers/drafting/eagle_timing.py)."""
        return eagle_timing.token_seconds(self, context, reps, rows)

    def measure_tree(self, depth: int, nodes: int, reps: int = 10) -> float:
        """Median seconds of a tree proposal of `depth` and `nodes` for one sequence after a
        128-row history (`tree_seconds`, the speculator's price of a tree)."""
        self.tree_seconds = eagle_timing.proposal_seconds(self, 128, reps, 1, depth, nodes)
        return self.tree_seconds

    def _can_draft(self, seq: EagleSeq) -> bool:
        return seq.can_draft

    # -- drafting ------------------------------------------------------------------------------

    def _draft(
        self,
        active: list[tuple[str, EagleSeq, list[int], int]],
        stop: Callable[[], bool],
        abandon: Callable[[], bool] | None = None,
        lookup_only: bool = False,
    ) -> dict[str, Draft]:
        # The head is one layer: giving up a forward inside it saves nothing worth the
        # bookkeeping, so it stops between forwards only (`stop` covers `abandon`).
        # A grammar reads the forced tokens and then each drafted token, and steps back after.
        grammars: dict[str, _Walk] = {}
        for rid, seq, forced, _ in active:
            if seq.grammar is not None:
                read = seq.grammar.try_advance(forced)
                if read == len(forced):
                    grammars[rid] = _Walk(seq.grammar, read)
                else:  # a guess the grammar refuses is never committed: draft freely
                    seq.grammar.rollback(read)
        try:
            drafts: dict[str, Draft] = {}
            if self.lookup is not None or any(item[1].prediction for item in active):
                rest = []
                lookup = self.lookup or NgramConfig()
                for item in active:
                    rid, seq, forced, n = item
                    text = seq.tokens + forced if forced else seq.tokens
                    found = []
                    if seq.prediction is not None:
                        found = seq.prediction.draft(text, n, lookup.min_n, lookup.max_n)
                    if not found and self.lookup is not None:
                        found = self._lookup(seq, text)[:n]
                    if found and rid in grammars:
                        found = found[: grammars[rid].grammar.valid_prefix(found)]
                    if found:
                        drafts[rid] = Draft(found)  # deterministic: q is one-hot
                    else:
                        rest.append(item)
                self.looked_up += len(drafts)
                active = rest
            if active and not lookup_only:
                drafts |= self._draft_with_head(active, stop, grammars)
            return drafts
        finally:
            for walk in grammars.values():
                walk.grammar.rollback(walk.read)

    def _draft_with_head(
        self,
        active: list[tuple[str, EagleSeq, list[int], int]],
        stop: Callable[[], bool],
        grammars: dict[str, _Walk],
    ) -> dict[str, Draft]:
        drafts: dict[str, Draft] = {}
        if self.loop is not None:  # greedy drafts, nothing forced, no grammar: the loop's
            loop = self.loop
            fits = [
                (rid, seq, n)
                for rid, seq, forced, n in active
                if not forced and rid not in grammars and seq.params.greedy and n <= loop.max_depth
            ]
            drafts, taken = self._loop_takes(loop, fits)
            if looped := [item for item in fits if item[0] in taken]:
                drafts |= loop.propose(looped)  # a draft, maybe empty, for each of them
        active = [item for item in active if item[0] not in drafts]
        if active:
            drafts |= self._draft_eagerly(active, stop, grammars)
        return drafts

    def _loop_takes(
        self, loop: EagleDraftLoop, items: list[tuple[str, EagleSeq, int]]
    ) -> tuple[dict[str, Draft], set[str]]:
        """Which of these (request id, sequence, k) a draft loop drafts now (at most its
        `max_seqs`). A sequence with more new feature rows than the loop's width (a prompt's,
        or several steps' drafted by prompt lookup) has all but the last fed to the head's
        cache first; those that ran out of head cache get an empty draft."""
        behind = [(rid, seq) for rid, seq, _ in items if seq.num_pending > loop.width]
        failed = (
            {rid: Draft([]) for rid in self._catch_up(behind[: loop.max_seqs])} if behind else {}
        )
        taken = [rid for rid, seq, k in items if rid not in failed and loop.takes(seq, k)]
        return failed, set(taken[: loop.max_seqs])

    def _catch_up(self, seqs: list[tuple[str, EagleSeq]]) -> list[str]:
        """Feed every pending feature row of these sequences but the last into the head's
        cache, so that a draft loop can take them (one new row each); returns the sequences
        that ran out of head cache (they start over later)."""
        return [] if self.trees.catch_up([seq for _, seq in seqs]) else [rid for rid, _ in seqs]

    def _draft_eagerly(
        self,
        active: list[tuple[str, EagleSeq, list[int], int]],
        stop: Callable[[], bool],
        grammars: dict[str, _Walk],
    ) -> dict[str, Draft]:
        head = self.head
        tokens: dict[str, list[int]] = {rid: [] for rid, _, _, _ in active}
        probs: dict[str, list[torch.Tensor]] = {rid: [] for rid, _, _, _ in active}
        confidence = {rid: ConfidenceStop(self.min_confidence) for rid, _, _, _ in active}
        # Step 1: rows for newly verified positions (or the last one again); its output gives
        # the first token after the committed ones.
        batch: list[tuple[str, EagleSeq, list[int], int, torch.Tensor]] = []
        fed_features: list[torch.Tensor] = []
        for rid, seq, forced, n in active:
            features = seq.new_rows()
            if features is None:
                continue
            batch.append((rid, seq, forced, n, self.trees.feature_rows(seq, features)))
            fed_features.append(features)
        try:
            a = self._forward([(seq, x) for _, seq, _, _, x in batch])
        except NoFreeBlocksError:  # out of head cache: these sequences start over later
            for _, seq, _, _, _ in batch:
                seq.reset()
            return {rid: Draft([]) for rid, _, _, _ in active}
        for (_, seq, _, _, _), features in zip(batch, fed_features, strict=True):
            seq.fed(features)
        # Then one row per token: the head's own output stands in for the target feature. The
        # forced tokens are fed as they are; after them, tokens are drawn.
        fed = dict.fromkeys(tokens, 0)  # forced tokens fed so far
        while True:
            rows = [r for r, (rid, _, forced, _, _) in enumerate(batch) if fed[rid] >= len(forced)]
            drawing = {row: i for i, row in enumerate(rows)}  # batch row -> row of logits
            logits = head.draft_logits(a[rows]) if rows else None
            next_batch: list[tuple[str, EagleSeq, list[int], int, torch.Tensor]] = []
            for row, (rid, seq, forced, n, _) in enumerate(batch):
                if fed[rid] < len(forced):
                    token = forced[fed[rid]]
                    fed[rid] += 1
                else:
                    assert logits is not None
                    i = drawing[row]
                    row_logits: torch.Tensor | None = logits[i : i + 1]
                    walk = grammars.get(rid)
                    if walk is not None:
                        row_logits = self._allowed_only(walk.grammar, logits[i : i + 1])
                    if row_logits is None:  # nothing in the draft vocabulary fits the grammar
                        continue
                    token, q, p = self._sample(seq, row_logits)
                    tokens[rid].append(token)
                    if q is not None:
                        probs[rid].append(q)
                    confidence[rid].drew(p)
                    if walk is not None:
                        walk.read += walk.grammar.try_advance([token])
                if len(tokens[rid]) < n and confidence[rid].sure:
                    token_ids = torch.tensor([token], device=a.device)
                    x = head.layer_input(a[row : row + 1], token_ids)
                    next_batch.append((rid, seq, forced, n, x))
            batch = next_batch
            if not batch or stop():
                break
            try:
                a = self._forward([(seq, x) for _, seq, _, _, x in batch])
            except NoFreeBlocksError:
                break  # propose what we have; these rows are rolled back next time anyway
        return {
            rid: Draft(tokens[rid], torch.cat(probs[rid]) if probs[rid] else None)
            for rid, _, _, _ in active
        }

    def _forward(self, batch: list[tuple[EagleSeq, torch.Tensor]]) -> torch.Tensor:
        """Head outputs for the last new row of each sequence, `[len(batch), hidden]`."""
        return self.trees.forward([(seq, x, None) for seq, x in batch])

    def _allowed_only(self, grammar: GrammarState, logits: torch.Tensor) -> torch.Tensor | None:
        """The head's draft-vocabulary logits (`[1, n]`) with what the grammar forbids at -inf;
        None when it allows none of them (or has ended)."""
        if grammar.stopped:
            return None
        allowed = grammar.allowed()[0][self.vocab].to(logits.device)
        if not bool(allowed.any()):
            return None
        return logits.masked_fill(~allowed, -torch.inf)

    def _sample(
        self, seq: EagleSeq, logits: torch.Tensor
    ) -> tuple[int, torch.Tensor | None, float]:
        """(token, q or None when greedy, the head's probability of the token: 1.0 unless a
        confidence bar needs it)."""
        params = seq.params
        if params.greedy:
            index = int(logits[0].argmax())
            p = greedy_probability(logits, index, self.min_confidence > 0)
            return int(self.vocab[index]), None, p
        full = torch.full((1, self.full_vocab_size), -torch.inf)
        full[0, self.vocab] = logits[0].float().cpu()
        q = params.probs(full)
        draws = None if seq.random is None else seq.random.next(len(seq.tokens))
        token = int(sample_from_probs(q, [draws])[0])
        return token, q, float(q[0, token])
