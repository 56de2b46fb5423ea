# Two entry points for a newcomer (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo peer test lint proto clean

$(STAMP): pyproject.toml setup.py compression/_native.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch pinned: a CPU build is cached on the project's machines; an unpinned one pulls CUDA wheels.
	$(BIN)/pip install -q torch==2.13.0
	# hf, lightning: the framework integrations' tests run against the real libraries;
	# monitor: the monitor's TensorBoard and wandb logs are tested too.
	$(BIN)/pip install -q -e ".[dev,torch,hf,lightning,monitor]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo_swarm.py

peer: $(STAMP)
	$(BIN)/swarmavg peer

# Four workers: most tests wait on timers and sockets; the ones that load the machine run
# one at a time in their own queue (tests/conftest.py).
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 -n 4 --dist loadgroup

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	# mypy resolves modules by path; a link tree gives it the installed `swarmavg.*` names.
	mkdir -p build/typecheck/swarmavg
	for d in proto compression dht averaging peer; do ln -sfn ../../../$$d build/typecheck/swarmavg/$$d; done
	cd build/typecheck && ../../$(BIN)/mypy --config-file ../../pyproject.toml \
		-p swarmavg.proto -p swarmavg.compression -p swarmavg.dht -p swarmavg.averaging -p swarmavg.peer

proto: $(STAMP)
	$(BIN)/python -m swarmavg.proto.generate

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
