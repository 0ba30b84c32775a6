"""The pools' part of the deployment config (cluster/config.py checks it with the rest): how many
actors each pool runs, what each asks Ray for, and what the drafter pool drafts with."""

from __future__ import annotations

from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A deployment config that cannot run; the message names the field."""


def check_field(condition: bool, where: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{where}: {message}")


@dataclass(frozen=True, slots=True)
class Resources:
    """What one actor of a pool asks Ray for."""

    cpus: float = 1.0
    gpus: float | None = None  # None: decided at start (`resolve_gpus`)
    memory_gb: float | None = None
    custom: dict[str, float] = field(default_factory=dict)  # e.g. {"grace_cpu": 1}

    def validate(self, where: str) -> None:
        check_field(self.cpus >= 0, f"{where}.cpus", f"must be >= 0, got {self.cpus}")
        check_field(
            self.gpus is None or self.gpus >= 0, f"{where}.gpus", f"must be >= 0, got {self.gpus}"
        )
        check_field(
            self.memory_gb is None or self.memory_gb > 0,
            f"{where}.memory_gb",
            "must be positive",
        )
        for name, amount in self.custom.items():
            check_field(bool(name) and amount > 0, f"{where}.custom.{name}", "must be positive")


@dataclass(frozen=True, slots=True)
class PrefillPool:
    replicas: int = 1  # 0: verifiers prefill their own prompts
    # Prompts shorter than this prefill on the verifier (conditional disaggregation).
    min_remote_prompt_tokens: int = 256
    # A remote prefill not back within timeout_s plus its tokens at min_tokens_per_s is given
    # up (the verifier prefills the prompt itself), and the worker is passed over for
    # retry_after_s: a worker cut off costs a request that long, not the link's timeout. (A
    # worker that fails at once, dead or restarting, is simply tried again next time.)
    timeout_s: float = 3.0
    min_tokens_per_s: float = 500.0
    retry_after_s: float = 10.0
    resources: Resources = field(default_factory=Resources)

    def deadline_s(self, tokens: int) -> float:
        """How long a remote prefill of `tokens` tokens may take."""
        return self.timeout_s + tokens / self.min_tokens_per_s


@dataclass(frozen=True, slots=True)
class VerifierPool:
    groups: int = 1  # independent tensor-parallel groups
    tensor_parallel_size: int = 1  # ranks (actors, GPUs in production) per group
    resources: Resources = field(default_factory=Resources)  # per rank


@dataclass(frozen=True, slots=True)
class DrafterPool:
    replicas: int = 1
    method: str = "eagle"
    num_speculative_tokens: int = 4
    draft_model: str | None = None  # for method draft_model: a smaller model, same tokenizer
    draft_layers: int | None = None  # or the target's first N layers as the draft model
    # For method eagle: an EAGLE-3 head, our file or a published folder (the bundled model has
    # one built in). A published head given as draft_model is taken as this.
    eagle_head: str | None = None
    draft_ahead: bool = True  # prepare the next proposal while the verifier checks this one
    # A draft model drafting ahead goes on across steps that only commit its guess (the step is
    # answered from what it drafted so far); false: every step stops it and waits for the
    # forward under way.
    keep_drafting_ahead: bool = True
    resources: Resources = field(default_factory=Resources)


@dataclass(frozen=True, slots=True)
class Pools:
    prefill: PrefillPool = field(default_factory=PrefillPool)
    verifier: VerifierPool = field(default_factory=VerifierPool)
    drafter: DrafterPool = field(default_factory=DrafterPool)
