"""The verifier's engine: continuous batching with speculative decoding, in one process.

Each `step()` drafts for the decoding sequences, schedules a token budget over everyone,
runs one forward of the target over all of it, rejection-samples the drafts, and commits:
tokens appended, rejected KV slots rolled back, drafters told, stop conditions checked.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from kernels.counter_rng import key_of_seed
from workers.drafting.base import EMPTY_DRAFT, Drafter
from workers.engine.admission import check_request
from workers.engine.async_steps import AsyncSteps
from workers.engine.calibration import (
    DraftCosts,
    TreeStepCosts,
    draft_costs_in_forwards,
    runner_one_token_seconds,
    step_verify_costs,
    tree_step_costs,
)
from workers.engine.config import EngineConfig, RequestSpec
from workers.engine.fair_share import DEFAULT_SHARE, Share
from workers.engine.graph_runner import GraphRunner, capture_sizes, make_runner, tree_widths
from workers.engine.logprobs import TokenLogprob, token_logprobs
from workers.engine.model_runner import ModelRunner, RunnerOutput
from workers.engine.output_text import OutputText
from workers.engine.outputs import (
    Completion,
    Continuation,
    Prefilled,
    RequestOutput,
    StepReport,
    StepTimes,
    in_order,
    record_output,
    step_report,
)
from workers.engine.penalty_rows import PenaltyRows
from workers.engine.sampler import DeviceSampler, HostSampler, Sampler
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledSeq, Scheduler
from workers.engine.sequence import SeqStatus, Sequence, SpecStats
from workers.engine.speculator import Speculator
from workers.engine.step_interrupt import Arrivals, interrupt_for
from workers.engine.structured import Grammars, StructuredOutput
from workers.engine.tree_verification import settle
from workers.engine.verification import (
    DeadEnd,
    Failed,
    kept_rows,
    sample_one,
    sampling_rows,
    verify,
)
from workers.kv_cache import BlockAllocator, BlockTable, NoFreeBlocksError
from workers.kv_cache.block_allocator import block_hashes
from workers.model.tokenizer import Tokenizer
from workers.model.transformer import ForwardInterrupted, TransformerLM

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        model: TransformerLM,
        config: EngineConfig | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: Seq[int] = (),
        drafters: dict[str, Drafter] | None = None,
        draft_costs: dict[str, float] | DraftCosts | None = None,
        runner: ModelRunner | None = None,
        sampler: Sampler | None = None,
        draft_seconds: dict[str, float] | None = None,
        progress: bool = False,
    ) -> None:
        """`runner` (default: `make_runner`, a graph runner on a GPU) holds the model and a KV
        cache of at least `config.kv_blocks` blocks; `sampler` (default: on the device for a
        GPU, on the host elsewhere) turns sampled rows into tokens. Draft costs come as
        `draft_costs` (one-token target forwards: a token's per method, or a `DraftCosts`) or
        as `draft_seconds`, divided by the engine's one-token forward as its runner times it
        (graphs included). `progress`: a progress bar while CUDA graphs are captured."""
        self.config = config or EngineConfig()
        max_len = min(self.config.max_model_len, model.config.max_context)
        self.max_model_len = max_len
        drafters = drafters or {}
        if runner is None:
            layers = sorted({layer for d in drafters.values() for layer in d.hidden_layers})
            runner = make_runner(model, self.config, layers, progress)
        if runner.model is not model or runner.kv_cache.num_blocks < self.config.kv_blocks:
            raise ValueError("the runner must hold this model and a cache of kv_blocks blocks")
        self.runner = runner
        self.sampler = sampler or (
            DeviceSampler() if model.device.type == "cuda" else HostSampler()
        )
        self.allocator = BlockAllocator(self.config.kv_blocks)
        self.scheduler = Scheduler(self.config)
        given = draft_costs or {}
        costs = given if isinstance(given, DraftCosts) else DraftCosts(dict(given))
        one_token_seconds = None
        if draft_seconds and any(draft_seconds.values()):
            one_token_seconds = runner_one_token_seconds(self.runner, self.allocator)
            costs = draft_costs_in_forwards(costs, drafters, draft_seconds, one_token_seconds)
        self.speculator = Speculator(
            self.config.spec,
            drafters,
            max_len,
            step_verify_costs(self.runner, self.allocator, self.config.spec, bool(drafters)),
            costs.tokens,
            model.config.vocab_size,
            costs.rows,
            costs.launches,
            one_token_seconds,
            costs.trees,
        )
        if self.config.spec.tree_nodes and self.config.spec.adaptive and drafters:
            self.speculator.trees.step_costs = self._tree_step_costs()
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        vocab = model.config.vocab_size
        self._grammars = None if tokenizer is None else Grammars(tokenizer, vocab, eos_token_ids)
        self.penalties = PenaltyRows(vocab, model.device)
        self.stats = SpecStats()
        self._seqs: dict[str, Sequence] = {}
        self._outputs: dict[str, RequestOutput] = {}
        # Each request's text, made as its outputs are taken (workers/engine/output_text.py);
        # an `EngineLoop` turns this off and makes the text in its callers' threads instead.
        self.makes_text = tokenizer is not None
        self._texts: dict[str, OutputText] = {}
        self._arrivals = itertools.count()
        # Called after every step that ran a forward (tracing); must not raise.
        self.step_listeners: list[Callable[[StepReport], None]] = []
        self._feature_bytes: dict[str, int] = {}
        # Async scheduling: steps launched before the last one is committed (async_steps.py).
        self.ahead = AsyncSteps(self)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        spec: RequestSpec | None = None,
        prefilled: Prefilled | None = None,
        continuation: Continuation | None = None,
        share: Share = DEFAULT_SHARE,
    ) -> None:
        """Queue a request; raises ValueError for one that can never run. With `prefilled`,
        the K/V of the prompt's first tokens go straight into the cache (remote prefill); with
        `continuation`, the request goes on from output generated by another engine. `share`:
        its tenant, weight and priority (workers/engine/fair_share.py)."""
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} already exists")
        check_request(
            prompt_token_ids,
            params,
            max_model_len=self.max_model_len,
            vocab_size=self.runner.model.config.vocab_size,
            has_tokenizer=self.tokenizer is not None,
            prefilled=prefilled,
            continuation=continuation,
        )
        carried = () if continuation is None else tuple(continuation.token_ids)
        grammar = None
        if params.structured is not None and self._grammars is not None:
            structured = params.structured
            if carried:  # the grammar reads the output so far first
                committed = (*structured.committed, *carried)
                structured = StructuredOutput(structured.grammar, committed)
            grammar = self._grammars.start(structured)
        method, max_spec_tokens = self.speculator.resolve(spec)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            spec_method=method,
            max_spec_tokens=max_spec_tokens,
            block_table=BlockTable(self.allocator, self.config.block_size, params.cache_salt),
            generator=None if params.seed is None else torch.Generator().manual_seed(params.seed),
            arrival=next(self._arrivals),
            eos_token_ids=self.eos_token_ids,
            grammar=grammar,
            rng_key=key_of_seed(params.seed if params.seed is not None else random.getrandbits(64)),
            share=share,
        )
        seq.token_limit = min(seq.token_limit, self.max_model_len)
        if continuation is not None:
            seq.token_ids += carried
            seq.stats.merge(continuation.stats)
        self._seqs[request_id] = seq
        tokenizer = self.tokenizer
        if self.makes_text and tokenizer is not None:
            self._texts[request_id] = OutputText(tokenizer, params, self.eos_token_ids, carried)
        self.speculator.add(seq)
        if prefilled is not None:
            try:
                logits = self._load_prefilled(seq, prefilled)
                if logits is not None:  # the whole prompt came: its first token needs no forward
                    seq.reseed()
                    token = sample_one(seq, logits)
                    if isinstance(token, DeadEnd):
                        self._finish(seq, "stop")
                    else:
                        num_top, rows = seq.params.logprobs, logits.view(1, -1)
                        logprobs = [] if num_top is None else token_logprobs(rows, [token], num_top)
                        self._append(seq, [token], logprobs)
            except Exception as exc:  # this request's own failure: it ends alone
                self._fail(seq, exc)
            if seq.finished:
                return
        self.scheduler.add(seq)

    def _load_prefilled(self, seq: Sequence, prefilled: Prefilled) -> torch.Tensor | None:
        """Write a remote prefill's K/V into fresh blocks (without room, the prompt is simply
        prefilled here instead); the last position's logits when it brought them."""
        n = prefilled.kv.shape[2]
        try:
            seq.block_table.prepare_write(0, n)
        except NoFreeBlocksError:
            return None
        slots = torch.tensor(seq.block_table.slots(0, n), device=self.runner.model.device)
        self.runner.write_prefilled(slots, prefilled.kv)
        seq.num_computed_tokens = n
        if prefilled.hidden:
            self.speculator.observe_hidden(seq, 0, prefilled.hidden)
        return prefilled.logits

    def cached_prefix_tokens(self, prompt_token_ids: Seq[int], cache_salt: int = 0) -> int:
        """Prompt tokens a new request would find in the prefix cache now (a hint)."""
        if not self.config.enable_prefix_caching:
            return 0
        hashes = block_hashes(prompt_token_ids[:-1], self.config.block_size, cache_salt)
        return self.allocator.num_cached(hashes) * self.config.block_size

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks (no-op for an unknown or finished id)."""
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.finished:
            self._finish(seq, "abort")

    def _tree_step_costs(self) -> TreeStepCosts | None:
        """Tree steps timed as this engine's runner serves them (calibration.py)."""
        spec, runner = self.config.spec, self.runner
        widths: Seq[int] = tree_widths(spec.tree_nodes, 1 + spec.num_speculative_tokens)
        seqs = min(spec.disable_batch_size, self.config.max_num_seqs)
        if isinstance(runner, GraphRunner):  # the widths and sizes it captured for trees
            widths, seqs = runner.tree_widths, runner.max_tree_seqs
        if seqs < 1:
            return None
        sizes = [b for b in capture_sizes(seqs) if b <= seqs]
        return tree_step_costs(runner, self.allocator, widths, sizes, self.max_model_len)

    @property
    def num_async_steps(self) -> int:
        """Steps launched ahead since the engine started."""
        return self.ahead.num_steps

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self, arrived: Arrivals | None = None) -> list[RequestOutput]:
        """One step; `arrived`: asked between layers for the requests that have come, for one
        the step is given up for (workers/engine/step_interrupt.py)."""
        if self.config.async_scheduling and self.runner.feeds_tokens and self.ahead.step():
            return self.take_outputs()
        start_ns, start = time.time_ns(), time.perf_counter()
        load = self.scheduler.num_unfinished  # what speculation is judged by this step
        decoding = self.scheduler.decoding()
        for seq in decoding:  # once a step, before drafting: drafts may draw too
            if seq.generator is not None:
                seq.reseed()
        self.speculator.propose(decoding, load)
        drafted = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.seqs:
            # Those that drew nothing yet this step: a prompt's last chunk, or a sequence admitted
            # already decoding (its prompt prefilled elsewhere), which `decoding` did not hold.
            drew = {id(seq) for seq in decoding if seq.generator is not None}
            for scheduled in batch.seqs:
                seq = scheduled.seq
                if seq.generator is not None and id(seq) not in drew:
                    seq.reseed()
            self.runner.copy_blocks(batch.block_copies)
            layers = self.speculator.hidden_layers((s.seq for s in batch.seqs), load)
            stop = interrupt_for(arrived, self.scheduler, self.runner, batch, layers)
            try:
                output = self.runner.forward(
                    [s.forward() for s in batch.seqs], hidden_layers=layers, interrupt=stop
                )
            except ForwardInterrupted:
                self.scheduler.give_back(batch)
                return self.take_outputs()
            verified = verify(batch.seqs, output, self.sampler, self.penalties)
            results: list[list[int] | None] = []
            for index, (scheduled, tokens) in enumerate(zip(batch.seqs, verified, strict=True)):
                if isinstance(tokens, Failed):  # its own verification raised: it ends alone
                    results.append(None)
                    self._fail(scheduled.seq, tokens.error)
                    continue
                if isinstance(tokens, DeadEnd):  # its settings let no token come next
                    results.append(None)
                    self._finish(scheduled.seq, "stop")
                    continue
                results.append(tokens)
                try:
                    if layers:
                        self._send_hidden(scheduled, tokens, output, index, layers)
                    if scheduled.seq.scores_prompt:
                        self._score_prompt(scheduled, output.logits_of(index))
                    num_top = scheduled.seq.params.logprobs
                    if num_top is None or not tokens:  # most requests: no rows to take
                        self._commit(scheduled, tokens, [])
                    else:
                        rows = sampling_rows(output, index, scheduled)
                        self._commit(scheduled, tokens, token_logprobs(rows, tokens, num_top))
                except Exception as exc:  # this request's own failure: it ends alone
                    self._fail(scheduled.seq, exc)
            speculator = self.speculator
            if speculator.times_this_step and all(s.decoding for s in batch.seqs):
                # A decode step whose draft lengths were chosen: what they cost, as served.
                speculator.observe_step(len(batch.seqs), time.perf_counter() - start)
            if self.step_listeners:
                self._report(batch.seqs, results, (start_ns, drafted - start, drafted))
            self.ahead.last_commit = time.perf_counter()
        return self.take_outputs()

    def _report(self, seqs: list[ScheduledSeq], results: list, times: StepTimes) -> None:
        """The step's report (`step_report`) to its listeners."""
        report = step_report(seqs, results, times, self._feature_bytes)
        for listener in self.step_listeners:
            listener(report)

    def generate(
        self,
        prompts: Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams],
        spec: RequestSpec | None = None,
    ) -> list[Completion]:
        """Run prompts to completion together (continuous batching); results in prompt order."""
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"gen-{next(self._arrivals)}-{i}" for i in range(len(prompts))]
        results = {rid: Completion(rid, list(p)) for rid, p in zip(ids, prompts, strict=True)}
        for rid, prompt, p in zip(ids, prompts, all_params, strict=True):
            self.add_request(rid, prompt, p, spec)
        while any(results[rid].finish_reason is None for rid in ids):
            for out in self.step():
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                result = results[out.request_id]
                result.token_ids += out.new_token_ids
                result.text += out.text
                result.logprobs += out.logprobs
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    result.finish_reason, result.spec = out.finish_reason, out.spec
        return [results[rid] for rid in ids]

    def _commit(
        self, scheduled: ScheduledSeq, tokens: list[int] | None, logprobs: list[TokenLogprob]
    ) -> None:
        seq = scheduled.seq
        if tokens is None:  # a prefill chunk short of the prompt's end
            seq.num_computed_tokens += scheduled.num_new_tokens
            return
        draft = scheduled.draft
        num_drafted = len(draft.token_ids) if draft.parents is None else draft.depth
        num_accepted = len(tokens) - 1
        if scheduled.path is not None:  # a tree's accepted nodes: their K/V to a chain's rows
            start, path = seq.num_computed_tokens, scheduled.path
            settle(self.runner.kv_cache, seq.block_table.block_ids, start, path)
        seq.num_computed_tokens += scheduled.num_new_tokens + num_accepted
        if scheduled.decoding:  # a verify step (the first token after prefill is not one)
            seq.stats.record(num_drafted, num_accepted)
            self.stats.record(num_drafted, num_accepted)
        self._append(seq, tokens, logprobs)

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob]) -> None:
        """Commit tokens whose K/V (all but the last) is in the cache: stop conditions, rollback
        of rejected slots, prefix-cache registration, outputs, drafters."""
        tokens, reason = self._cut_at_stop(seq, tokens)
        if seq.grammar is not None:
            tokens = tokens[: seq.grammar.advance(tokens)]
            if seq.grammar.stopped:  # the answer is complete: EOS, the only token left, is moot
                reason = "stop"
        if logprobs:
            del logprobs[len(tokens) :]
        seq.token_ids += tokens
        if seq.draft.token_ids:  # roll back rejected draft slots (a plain step has none)
            seq.block_table.truncate(seq.num_computed_tokens)
            seq.draft = EMPTY_DRAFT
        if self.config.enable_prefix_caching:
            seq.block_table.cache_full_blocks(seq.token_ids, seq.num_computed_tokens)
        record_output(self._outputs, seq, tokens, logprobs)
        if reason:
            self._finish(seq, reason)
        else:
            self.speculator.commit(seq, tokens)

    def _score_prompt(self, scheduled: ScheduledSeq, rows: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens this chunk's rows predict (row r of a
        chunk from position `start` scores prompt token start + r + 1); a chunk computed
        again after preemption writes over what it wrote before."""
        seq, start = scheduled.seq, scheduled.seq.num_computed_tokens
        end = min(start + scheduled.num_new_tokens, seq.num_prompt_tokens - 1)
        num_top = seq.params.prompt_logprobs or 0
        targets = seq.token_ids[start + 1 : end + 1]
        seq.prompt_logprobs[start:end] = token_logprobs(rows, targets, num_top)

    def _send_hidden(
        self,
        scheduled: ScheduledSeq,
        tokens: list[int] | None,
        output: RunnerOutput,
        index: int,
        layers: tuple[int, ...],
    ) -> None:
        """Features of the positions this forward computed and kept (not rejected drafts)."""
        kept = scheduled.num_new_tokens + (len(tokens) - 1 if tokens else 0)
        rows = {
            layer: kept_rows(output.hidden_of(layer, index), scheduled, kept) for layer in layers
        }
        seq = scheduled.seq
        sent = self.speculator.observe_hidden(seq, seq.num_computed_tokens, rows)
        if sent and self.step_listeners:
            self._feature_bytes[seq.request_id] = sent

    def _cut_at_stop(self, seq: Sequence, tokens: list[int]) -> tuple[list[int], str | None]:
        """Keep tokens up to the first stop condition; the reason, if one was met."""
        room, ends = seq.token_limit - len(seq.token_ids), seq.end_token_ids
        if len(tokens) == 1:  # a decode step's one token
            return tokens, "stop" if tokens[0] in ends else "length" if room <= 1 else None
        for n, token in enumerate(tokens, start=1):
            if token in ends:
                return tokens[:n], "stop"
            if n >= room:
                return tokens[:n], "length"
        return tokens, None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self.scheduler.remove(seq)
        self.speculator.remove(seq)
        self.penalties.release(seq.request_id)
        record_output(self._outputs, seq, [])
        out = self._outputs[seq.request_id]
        out.finished, out.finish_reason = True, reason
        if seq.params.prediction:
            out.accepted_prediction_tokens = in_order(seq.params.prediction, seq.output_token_ids)
        del self._seqs[seq.request_id]

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        """End a request whose own work raised (a bug in one request's grammar, say) with
        finish reason "error", freeing its blocks; the other requests in the batch go on."""
        log.error("request %s failed", seq.request_id, exc_info=exc)
        if seq.request_id in self._seqs:
            self._finish(seq, "error")
        else:  # it had finished before the failure: the error replaces its end
            record_output(self._outputs, seq, [])
        out = self._outputs[seq.request_id]
        out.finished, out.finish_reason = True, "error"
        out.error = f"{type(exc).__name__}: {exc}"

    def take_outputs(self) -> list[RequestOutput]:
        """What requests produced since the last call: a step's outputs, or, between steps, a
        remote prefill's first token (delivered at once instead of after the next forward),
        with their text where the engine makes it (`makes_text`)."""
        outputs = list(self._outputs.values())
        self._outputs.clear()
        for out in outputs:  # a reader on another thread must not see later steps' counts
            out.spec = out.spec.copy()
        texts = self._texts
        if not texts:
            return outputs
        for out in outputs:
            text = texts.get(out.request_id)
            if text is None:  # a request added while the engine made no text
                continue
            if text.apply(out):  # a stop string ended it: the engine's request goes too
                self.abort_request(out.request_id)
                self._outputs.pop(out.request_id)
            if out.finished:
                del texts[out.request_id]
        return outputs
