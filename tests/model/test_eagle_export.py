"""The shipped head through the published EAGLE-3 layout: `python -m workers.eagle.export` writes
the folder vLLM and SGLang read; read back here it drafts the tokens the shipped head drafts,
and served from it greedy output is plain decoding's (fp32 floats: the export's LM head rows are
the target's floats)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.model.helpers import plain_tokens, run_staggered
from tests.model.test_speculative_exact import GREEDY, SPEC, prompt_texts
from workers.drafting.base import DraftRequest
from workers.drafting.eagle import EagleDrafter
from workers.eagle.export import main as export_main
from workers.eagle.head import BUNDLED_HEAD
from workers.eagle.layout import is_eagle3_folder, load_head
from workers.engine.config import EngineConfig, RequestSpec
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "smollm2-eagle3"
    export_main(["--out", str(out), "--dtype", "float32"])
    return out


def test_the_folder_is_the_published_layout(exported: Path, checkpoint) -> None:  # type: ignore[no-untyped-def]
    assert is_eagle3_folder(exported)
    config = json.loads((exported / "config.json").read_text())
    shipped = load_head(BUNDLED_HEAD)
    layers = list(shipped.config.target_layers)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 8192
    assert config["target_hidden_size"] == checkpoint.config.hidden_size
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == layers
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in layers]
    assert max(i + 1 for i in layers) < checkpoint.config.num_layers  # vLLM captures inputs


def test_read_back_it_drafts_what_the_shipped_head_drafts(exported: Path, model_fp32) -> None:  # type: ignore[no-untyped-def]
    config = model_fp32.config
    ours = EagleDrafter(load_head(BUNDLED_HEAD), model_fp32, num_blocks=128)
    theirs = EagleDrafter(load_head(exported, config), model_fp32, num_blocks=128)
    assert theirs.head.own_lm_head is not None and ours.head.own_lm_head is None
    width = len(ours.hidden_layers) * config.hidden_size
    gen = torch.Generator().manual_seed(0)
    for n in (3, 17, 40):
        tokens = torch.randint(0, config.vocab_size, (n + 1,), generator=gen).tolist()
        features = torch.randn(n, width, generator=gen)
        drafts = []
        for drafter in (ours, theirs):
            drafter.add("a", tokens, SamplingParams(temperature=0.0))
            drafter.observe_hidden("a", 0, features)
            drafts.append(drafter.propose([DraftRequest("a", n + 1, 6)])["a"].token_ids)
            drafter.remove("a")
        assert drafts[0] == drafts[1] and len(drafts[0]) > 0


def test_greedy_output_with_the_exported_head_is_plain_decodings(  # type: ignore[no-untyped-def]
    exported: Path, model_fp32, checkpoint
) -> None:
    prompts = [checkpoint.tokenizer.encode(t) for t in prompt_texts()[:4]]
    eos = checkpoint.config.eos_token_ids
    head = load_head(exported, model_fp32.config)
    drafter = EagleDrafter(head, model_fp32, num_blocks=1024)
    config = EngineConfig(max_model_len=512, spec=SPEC)
    engine = LLMEngine(model_fp32, config, eos_token_ids=eos, drafters={"eagle": drafter})
    got = run_staggered(engine, prompts, GREEDY, RequestSpec(method="eagle"))
    assert got == plain_tokens(model_fp32, eos, prompts, GREEDY)
    assert engine.stats.accepted > 0
