# The two commands of the README: `make reports` (the main job) and `make test`. Each sets up what it needs.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
# A GPU node usually has its own CUDA torch: reuse it (system site-packages) instead of installing one.
HAVE_CUDA_TORCH := $(shell $(PYTHON) -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && echo 1)

.PHONY: setup reports test lab clean-venv

setup: $(VENV)/.moe_lab-ready

$(VENV)/.moe_lab-ready: pyproject.toml
	@echo "== setting up $(VENV) (torch: $(if $(HAVE_CUDA_TORCH),the node's CUDA build,$(TORCH)))"
	$(PYTHON) -m venv $(if $(HAVE_CUDA_TORCH),--system-site-packages) $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(HAVE_CUDA_TORCH),,$(BIN)/python -m pip install -q "$(TORCH)")
	$(BIN)/python -m pip install -q -e ".[test]"
	@touch $@

# Main job: every numbered notebook → reports/<profile>-<date>/ (git-ignored; HTML + results.json); gpu profile if a GPU is visible.
reports: setup
	$(BIN)/moe-lab run $(ARGS)

# Tests: the unit tier on every core (pytest-xdist); the cluster tier (4 gloo engines) three test files at a time: most
# of its time is spent waiting (timeouts, heartbeats, engines starting): two left 2 cores ~21 % idle, three 6-11 %
# (docs/bench.md); a file stays on one worker (its module-scoped cluster is started once) and each test tells its own
# processes apart from the other workers'; then the notebook tier (whole `moe-lab run`s, each with its kernels and its
# own cluster) and the GPU tests (skipped without GPUs), a file to a worker: the tier's run of every notebook and the
# tests that read it on one, the report-folder and %%px files (a core mostly idle) on the other. Every run goes whatever the others say; a run that
# selects no test (-k) is not a failure.
UNIT_WORKERS ?= auto
CLUSTER_WORKERS ?= 3
NOTEBOOK_WORKERS ?= 2
test: setup
	@rc=0; \
	for tier in "-n $(UNIT_WORKERS) tests/unit" "-n $(CLUSTER_WORKERS) --dist loadfile tests/cluster" \
			"-n $(NOTEBOOK_WORKERS) --dist loadfile tests/notebooks tests/gpu"; do \
		echo "== pytest $(PYTEST_ARGS) $$tier"; \
		$(BIN)/python -m pytest $(PYTEST_ARGS) $$tier; r=$$?; \
		if [ $$r -ne 0 ] && [ $$r -ne 5 ]; then rc=$$r; fi; \
	done; exit $$rc

lab: setup
	$(BIN)/moe-lab lab

clean-venv:
	rm -rf $(VENV)
