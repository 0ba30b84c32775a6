"""Drafters users bring (`package.module:Class`): the example of docs/design.md loads, drafts and
is exact against plain decoding; a name that is no drafter is refused saying why; a drafter that
raises stops speculation for its requests only."""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.factories import tiny_model
from tests.model.helpers import plain_tokens, run_staggered
from tests.model_files import bundled_tokenizer
from workers.drafting.base import Draft, Drafter, DraftRequest
from workers.drafting.user import DrafterContext, load_user_drafter
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.factory import ModelSpec, build_drafters
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.model.transformer import TransformerLM

DOCS = Path(__file__).parents[2] / "docs" / "design.md"
EXAMPLE = "outrider_example_drafters:CopyLastDrafter"
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def docs_example() -> str:
    """The example drafter's code, as docs/design.md shows it."""
    found = re.search(
        r"<!-- example-drafter -->\n```python\n(.*?)```\n<!-- /example-drafter -->",
        DOCS.read_text(),
        re.S,
    )
    assert found, "docs/design.md lost its example drafter"
    return found.group(1)


@pytest.fixture
def example_module(tmp_path: Path) -> Iterator[Path]:
    """The docs' example as a module users would install (on sys.path for this test)."""
    (tmp_path / "outrider_example_drafters.py").write_text(docs_example())
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    sys.modules.pop("outrider_example_drafters", None)


class RaisingDrafter(Drafter):
    """Raises in `propose` from its second call on."""

    def __init__(self, context: DrafterContext) -> None:
        self.calls = 0

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        pass

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        pass

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("a bug in the user's drafter")
        return {r.request_id: Draft([1] * r.k) for r in requests}

    def remove(self, request_id: str) -> None:
        pass


class NotADrafter:
    pass


@pytest.fixture(scope="module")
def model() -> TransformerLM:
    return tiny_model(seed=6)


def context(model: TransformerLM, method: str) -> DrafterContext:
    return DrafterContext(method, model.config, 4, 256, "cpu", bundled_tokenizer())


def engine(model: TransformerLM, drafter: Drafter) -> LLMEngine:
    spec = SpecConfig(method=drafter.method, num_speculative_tokens=4, adaptive=False)
    config = EngineConfig(max_model_len=256, spec=spec)
    return LLMEngine(model, config, drafters={drafter.method: drafter})


def test_the_docs_example_drafter_is_exact(model: TransformerLM, example_module: Path) -> None:
    """Built by the factory as an engine's (or a drafter actor's) default method, drafting
    from its `DrafterContext`, output as plain decoding's."""
    settings = EngineConfig(max_model_len=256, spec=SpecConfig(method=EXAMPLE))
    built, seconds = build_drafters(ModelSpec(), settings, model.config, None, None, only=EXAMPLE)
    drafter = built[EXAMPLE]
    assert type(drafter).__name__ == "CopyLastDrafter" and drafter.method == EXAMPLE
    assert EXAMPLE not in seconds  # priced as model-free drafters are
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 3, 9, 3, 9], [1, 2, 3, 4]]
    eng = engine(model, drafter)
    got = run_staggered(eng, prompts, PARAMS, RequestSpec(method=EXAMPLE))
    assert got == plain_tokens(model, (), prompts, PARAMS)
    assert eng.stats.drafted > 0 and eng.stats.accepted > 0


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("outrider_no_such_module:Drafter", "cannot import outrider_no_such_module"),
        (f"{__name__}:NotADrafter", "not a subclass of workers.drafting.base.Drafter"),
        (f"{__name__}:Missing", "not a subclass"),
        ("not a method", "not a drafter class"),
    ],
)
def test_a_name_that_is_no_drafter_is_refused(
    model: TransformerLM, method: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_user_drafter(context(model, method))


def test_user_methods_pass_validation_and_bad_names_do_not() -> None:
    assert SpecConfig(method="my.pkg:MyDrafter").method == "my.pkg:MyDrafter"
    assert RequestSpec(method="my.pkg:MyDrafter").method == "my.pkg:MyDrafter"
    for bad in ("my.pkg:", ":Cls", "my pkg:Cls", "eagle3"):
        with pytest.raises(ValueError, match=r"package\.module:Class"):
            SpecConfig(method=bad)


def test_a_drafter_that_raises_only_stops_speculation(model: TransformerLM) -> None:
    method = f"{__name__}:RaisingDrafter"
    drafter = load_user_drafter(context(model, method))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    eng = engine(model, drafter)
    got = run_staggered(eng, prompts, PARAMS, RequestSpec(method=method))
    assert got == plain_tokens(model, (), prompts, PARAMS)
    assert eng.speculator.failures[method] >= 1  # each call that raised, counted


def test_the_example_reads_as_the_docs_say() -> None:
    """The docs' code is the module users copy: it compiles and defines the class."""
    namespace: dict[str, object] = {}
    exec(compile(textwrap.dedent(docs_example()), "example", "exec"), namespace)
    assert isinstance(namespace["CopyLastDrafter"], type)
