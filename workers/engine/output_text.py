"""A request's text, made from its engine outputs where they are read, not in the engine's step.

The engine commits tokens; `OutputText` turns each `RequestOutput`'s new tokens into its new
text and ends the text at a stop string (workers/engine/detokenizer.py), as vLLM's output
processor does beside its engine core. An `EngineLoop` makes it in its callers' threads (an
event loop, or the thread reading `submit`), so the engine's thread, whose host work stands
between the device's forwards, spends none of it on text. Called synchronously
(`LLMEngine.step`), the engine makes it itself at the end of each step.

A stop string is found a step or so after its tokens were committed when the text is made
outside the step: the output that holds it becomes the request's last (finished, "stop"), the
caller aborts the engine's request, and whatever the engine committed after it is dropped
unread. The text, the tokens it reports and the finish reason are those of a stop found in
the step.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.outputs import RequestOutput, in_order
from workers.engine.sampling_params import SamplingParams
from workers.model.tokenizer import Tokenizer


class OutputText:
    def __init__(
        self,
        tokenizer: Tokenizer,
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        carried: Sequence[int] = (),
    ) -> None:
        """`carried`: output a continued request generated on another engine, whose text was
        sent from there (what it held back comes out here)."""
        self._detokenizer = IncrementalDetokenizer(
            tokenizer,
            params.stop,
            params.min_tokens,
            params.skip_special_tokens,
            params.include_stop_str_in_output,
        )
        # A stop token or EOS ends the text without being in it (as vLLM does), whether or not
        # the text shows special tokens; unless the request asks for it.
        shows_end = params.include_stop_str_in_output
        self._hidden_end = frozenset() if shows_end else params.end_token_ids(eos_token_ids)
        self._prediction = params.prediction
        # The output so far, kept only to count a prediction's tokens in it once it ends
        self._token_ids = list(carried) if params.prediction else []
        if carried:
            self._detokenizer.add(carried)

    def apply(self, out: RequestOutput) -> bool:
        """Fill in `out.text`. True when a stop string ended the text in an output the engine
        had not ended: `out` is then the request's last (finished, "stop"), and the engine's
        request is to be aborted."""
        tokens = out.new_token_ids
        if self._prediction:
            self._token_ids += tokens
        detokenizer = self._detokenizer
        ends = out.finished and tokens and tokens[-1] in self._hidden_end
        shown = tokens[:-1] if ends else tokens
        out.text = detokenizer.add(shown) if shown else ""
        if out.finish_reason in ("abort", "error"):  # no answer's end: what is held back stays
            return False
        abort = detokenizer.stopped and not out.finished
        if detokenizer.stopped:
            out.finished, out.finish_reason = True, "stop"
        if abort and self._prediction:
            out.accepted_prediction_tokens = in_order(self._prediction, self._token_ids)
        if out.finished:
            out.text += detokenizer.flush()  # what was held back is the answer's end
        return abort
