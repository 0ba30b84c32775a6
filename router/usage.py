"""OpenAI's usage object of an answer, with Outrider's speculative statistics."""

from __future__ import annotations

from collections.abc import Sequence

from router.backends import Step
from router.protocol import GenerateRequest
from workers.engine.sequence import SpecStats


def usage(
    requests: Sequence[GenerateRequest], last_steps: Sequence[Step | None]
) -> dict[str, object]:
    """OpenAI's usage object over a request's prompts and choices (their last steps, in choice
    order; None for a choice with none yet), with Outrider's speculative statistics: each
    prompt counted once, the choices' tokens and drafts summed."""
    steps = [step for step in last_steps if step is not None]
    prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    if requests[0].score_only:  # the token the engine generated is not part of the answer
        completion_tokens = 0
    else:
        completion_tokens = sum(step.num_output_tokens for step in steps)
    spec = SpecStats()
    for step in steps:
        spec.merge(step.spec)
    # Each prompt's own cache hits: its first choice's (the others start from its blocks).
    n = requests[0].n
    cached = sum(step.num_cached_tokens for step in last_steps[::n] if step is not None)
    answer: dict[str, object] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
        "speculative": spec.as_dict(),
    }
    done = [step for step in steps if step.finished]  # counted once a choice is over
    if (predicted := len(requests[0].params.prediction)) and done:  # OpenAI's Predicted Outputs
        accepted = sum(step.accepted_prediction_tokens for step in done)
        answer["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": predicted * len(done) - accepted,
        }
    return answer
