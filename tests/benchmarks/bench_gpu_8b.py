"""bench_gpu's part 5: a model of Llama-3.1-8B's shape with random bf16 weights made on the
device (nothing on the host). Forward costs by new tokens through the captured graphs, the
decode step of 64 sequences alone, and served decoding at batch 1 and 64 (an engine with a
GPU-sized step budget, as bench_gpu's: prefill steps timed apart from decode steps), each
against its floor: the bytes a step must read (weights, and the KV cache) over the measured
copy bandwidth."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from tests.benchmarks.bench_gpu import CONTEXT, PREFILL_BUDGET, sync
from workers.engine.calibration import runner_samples
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import StepReport
from workers.engine.sampling_params import SamplingParams
from workers.model.config import ModelConfig
from workers.model.transformer import TransformerLM

LLAMA_8B = ModelConfig(
    architecture="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    attention_bias=False,
    name="Llama-3.1-8B shape, random weights",
)
EIGHT_B_COUNTS = (1, 2, 5, 9, 17, 64)


def random_model(config: ModelConfig, device: torch.device) -> TransformerLM:
    """`config`'s shape with random bf16 weights, made on the device (nothing on the host)."""
    model = TransformerLM(config).to(dtype=torch.bfloat16).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def eight_b(
    device: torch.device,
    copy_gb_s: float,
    max_tokens: int,
    shape: ModelConfig = LLAMA_8B,
    async_scheduling: bool = False,
) -> dict[str, Any]:
    """The part's measurements for a model of `shape` (Llama-3.1-8B's; a small one checks the
    script on a CPU). With `async_scheduling` a decode step's time runs from its launch to its
    commit, one step later (workers/engine/overlap.py)."""
    model = random_model(shape, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    config = EngineConfig(
        max_model_len=1024,
        max_num_seqs=64,
        max_num_batched_tokens=PREFILL_BUDGET,  # a GPU's: the CPU's 512 split prefills in four
        num_kv_blocks=64 * 24,
        async_scheduling=async_scheduling,
        spec=SpecConfig(num_speculative_tokens=16, adaptive=False),
    )
    start = time.perf_counter()
    engine = LLMEngine(model, config)
    startup_s = time.perf_counter() - start
    blocks = engine.allocator.allocate(-(-(CONTEXT + max(EIGHT_B_COUNTS)) // 16))
    samples = runner_samples(engine.runner, blocks, EIGHT_B_COUNTS, 10, CONTEXT)
    # The decode step of 64 sequences alone: 64 one-token sequences over the same context.
    (batch_step,) = runner_samples(engine.runner, blocks, [64], 10, CONTEXT, width=1)
    engine.allocator.free(blocks)
    forward_ms = [1000 * statistics.median(s) for s in samples]
    kv_per_token = 2 * shape.num_layers * shape.kv_size * 2
    bandwidth = copy_gb_s * 1e9  # bytes moved per second, as a step reads them

    def floor_ms(batch: int, context: float) -> float:
        return 1000 * (weight_bytes + batch * context * kv_per_token) / bandwidth

    gen = torch.Generator().manual_seed(0)
    decode = {}
    prompt_len = 128
    reports: list[StepReport] = []
    engine.step_listeners.append(reports.append)
    for batch in (1, 64):
        prompts = torch.randint(0, shape.vocab_size, (batch, prompt_len), generator=gen)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        engine.generate(prompts[:, :16].tolist(), SamplingParams(max_tokens=4, temperature=0))
        sync()
        reports.clear()
        t0 = time.perf_counter()
        engine.generate(prompts.tolist(), params, RequestSpec(enabled=False))
        sync()
        seconds = time.perf_counter() - t0
        # A step that decodes every sequence, apart from those that computed prompt chunks.
        decoding = [
            r.forward_s + r.draft_s
            for r in reports
            if len(r.rounds) == batch and all(x.prefill_tokens == 0 for x in r.rounds)
        ]
        decode[str(batch)] = {
            "tokens_per_s": batch * max_tokens / seconds,
            "step_ms": 1000 * seconds / max_tokens,  # prefill included
            "decode_step_ms": 1000 * statistics.median(decoding) if decoding else None,
            "prefill_steps": sum(1 for r in reports if not r.verified),
            "floor_ms": floor_ms(batch, prompt_len + max_tokens / 2),
        }
    return {
        "step_ms": {"1": forward_ms[0], "64": 1000 * statistics.median(batch_step)},
        "step_floor_ms": {"1": floor_ms(1, CONTEXT), "64": floor_ms(64, CONTEXT)},
        "weight_gb": weight_bytes / 1e9,
        "startup_s": startup_s,
        "counts": list(EIGHT_B_COUNTS),
        "forward_ms": forward_ms,
        "decode": decode,
        "memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0,
    }
