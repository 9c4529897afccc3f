# Every target sets up .venv by itself: torch is pinned first (a local CPU build), then the package.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.headwise-installed
TORCH   ?= torch==2.13.0
JOBS    ?= 2

.PHONY: demo test hf-tests hf-tests-slice bench bench-quick clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/headwise tour

test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -n $(JOBS) --dist loadgroup -q
	$(MAKE) hf-tests-slice

# Hugging Face's own model tests with every model patched by headwise (docs/interop_hf.md, "Hugging Face's own tests")
hf-tests: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) tests/hf_suite/run.py

# the CI slice of hf-tests: three families (learned positions, fused QKV, encoder-decoder with position bias), every test kind; skips (one line, exit 0) without a package registry
hf-tests-slice: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) tests/hf_suite/run.py --skip-if-unavailable --families opt phi3 t5

bench: $(STAMP)
	$(PY) -m benchmarks --processes 3

bench-quick: $(STAMP)
	$(PY) -m benchmarks --quick

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .hypothesis
