"""The EAGLE training pipeline end to end on a few prompts (the shipped head is never retrained
by the tests), and the shipped head itself: its manifest, its metadata, its fit to the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from workers.eagle.head import BUNDLED_HEAD
from workers.eagle.layout import head_metadata, load_head
from workers.eagle.prompts import held_out_prompts, training_prompts
from workers.eagle.self_instruct import (
    keep_turn,
    load_self_instruct_prompts,
    sample_user_turns,
    user_turn_prefix,
)
from workers.eagle.train import main, sha256_of

pytestmark = pytest.mark.slow


def test_training_smoke_writes_a_loadable_head(tmp_path: Path) -> None:
    out = tmp_path / "head.safetensors"
    log = tmp_path / "log.jsonl"
    args = ["--seed", "1", "--limit", "4", "--max-answer-tokens", "12", "--epochs", "2"]
    args += ["--batch-tokens", "256", "--draft-vocab", "512", "--no-progress"]
    main([*args, "--output", str(out), "--log", str(log)])
    head = load_head(out)
    assert head.config.draft_vocab_size == 512
    manifest = json.loads(out.with_suffix(".json").read_text())
    assert manifest["sha256"] == sha256_of(out)
    assert head_metadata(out)["command"].startswith("python -m workers.eagle.train --seed 1")
    events = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    assert events[0] == "start" and events[-1] == "done" and "train" in events


def test_data_only_makes_the_data_and_trains_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "head.safetensors"
    args = ["--seed", "1", "--limit", "2", "--max-answer-tokens", "6", "--prompts", "templates"]
    main([*args, "--data-only", "--max-num-seqs", "2", "--output", str(out)])
    assert "templates: 2 sequences" in capsys.readouterr().out
    assert not out.exists()


def test_shipped_head_matches_its_manifest_and_the_bundled_model(checkpoint) -> None:  # type: ignore[no-untyped-def]
    manifest = json.loads(BUNDLED_HEAD.with_suffix(".json").read_text())
    assert manifest["file"] == BUNDLED_HEAD.name
    assert manifest["sha256"] == sha256_of(BUNDLED_HEAD)
    assert manifest["command"].startswith("python -m workers.eagle.train")
    head = load_head(BUNDLED_HEAD)
    assert head.config.target_name == checkpoint.config.name
    assert head.config.hidden_size == checkpoint.config.hidden_size
    assert max(head.config.target_layers) < checkpoint.config.num_layers
    assert int(head.draft_vocab.max()) < checkpoint.config.vocab_size
    assert all(torch.isfinite(p).all() for p in head.parameters())


def test_the_target_writes_user_turns(checkpoint, model_fp32) -> None:  # type: ignore[no-untyped-def]
    tokenizer = checkpoint.tokenizer
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).startswith(
        user_turn_prefix(tokenizer) + "hi"
    )
    turns = sample_user_turns(
        model_fp32, tokenizer, count=3, seed=5, max_tokens=48, chunk=8, progress=False
    )
    assert 1 <= len(turns) <= 3
    assert len({t.lower() for t in turns}) == len(turns)
    assert all(keep_turn(t, True, []) and "<|im_" not in t for t in turns)
    # Each sample's seed is its index, so other chunks and batch sizes draw the same turns;
    # after each chunk the turns so far are handed on (the CLI writes its file then).
    seen: list[list[str]] = []
    again = sample_user_turns(
        model_fp32,
        tokenizer,
        count=3,
        seed=5,
        max_tokens=48,
        chunk=4,
        max_num_seqs=2,
        progress=False,
        on_chunk=lambda so_far: seen.append(list(so_far)),
    )
    assert again == turns
    assert seen and seen[-1] == turns
    assert all(snapshot == turns[: len(snapshot)] for snapshot in seen)


def test_shipped_self_instruct_prompts_are_distinct_and_held_out_stays_out() -> None:
    prompts = load_self_instruct_prompts()
    assert len(prompts) >= 1000
    assert len({" ".join(p.lower().split()) for p in prompts}) == len(prompts)
    held_out = [p for kind in held_out_prompts().values() for p in kind]
    assert all(keep_turn(p, True, held_out) for p in prompts)
    assert not set(prompts) & set(training_prompts(0))
