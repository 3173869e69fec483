# `make install` sets up .venv from scratch; `make run` runs the demo job; `make test` runs the test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: install run test test-extended bench etcd clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev,data]'
	touch $@

run: install
	$(BIN)/python examples/demo.py

# three pytest processes, each test file whole in one of them (its module fixtures, e.g. an etcd cluster, made
# once): much of a test is waiting (timeouts, a job's steps), so on 2 cores three at once leave less idle than two
test: install
	$(BIN)/python -m pytest -n 3 --dist loadfile

test-extended: install
	$(BIN)/python -m pytest -m extended

bench: install
	$(BIN)/python benchmarks/restart_latency.py
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/snapshot.py
	$(BIN)/python benchmarks/erasure.py
	$(BIN)/python benchmarks/priority.py
	$(BIN)/python benchmarks/persist_rounds.py
	$(BIN)/python benchmarks/node_loss.py

etcd: install
	$(BIN)/python tests/etcd_cluster.py

clean:
	rm -rf $(VENV) runs .pytest_cache
