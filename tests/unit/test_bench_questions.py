"""bench_served's questions: never a prompt twice, and no subject again within a server's round
(`make serve`'s shared n-gram pool would draft it from its last answer)."""

from __future__ import annotations

from tests.benchmarks.bench_served import FreshQuestions, batches
from tests.benchmarks.questions import SUBJECTS


def test_a_round_of_a_server_never_asks_a_subject_twice() -> None:
    fresh = FreshQuestions()
    asked = fresh(1)  # the warm-up
    for level in (1, 4, 16, 32):
        for _ in range(batches(level)):
            asked += fresh(level)
    assert len(asked) == 65 < len(SUBJECTS)
    subjects = [next(s for s in SUBJECTS if s in question) for question in asked]
    assert len(set(subjects)) == len(asked)
    later = fresh(300)  # many rounds on: still no prompt asked before
    assert not set(later) & set(asked) and len(set(later)) == 300
