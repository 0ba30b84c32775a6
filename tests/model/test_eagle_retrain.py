"""The one-call EAGLE retraining (workers/eagle/retrain.py) on the CPU, `--quick`: every stage
runs, its files land in `--out`, the head loads, and a time budget cuts training short."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.eagle.layout import load_head
from workers.eagle.retrain import parse_args, run
from workers.eagle.train import TIMED_STEPS

pytestmark = pytest.mark.slow


def test_quick_retraining_writes_a_head_and_its_summary(tmp_path: Path) -> None:
    argv = ["--quick", "--out", str(tmp_path)]
    args = parse_args(argv)
    args.epochs, args.minutes = 40.0, 0.05  # more steps than the budget leaves room for
    result = run(args, argv)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "head.safetensors",
        "summary.json",
        "train.jsonl",
        "turns.json",
    ]
    assert json.loads((tmp_path / "summary.json").read_text()) == result
    assert 1 <= result["turns"] <= 4 and result["sequences"] >= 1  # type: ignore[operator]
    assert result["train"]["steps"] == TIMED_STEPS  # type: ignore[index]
    acceptance = result["held_out_acceptance"]
    assert acceptance["shipped"] > 1.0  # type: ignore[index]
    assert result["better"] == (acceptance["new"] > acceptance["shipped"])  # type: ignore[index]
    head = load_head(tmp_path / "head.safetensors")
    assert head.config.draft_vocab_size == 512
    events = [json.loads(line)["event"] for line in (tmp_path / "train.jsonl").open()]
    assert events[0] == "start" and "budget" in events and events[-1] == "done"
