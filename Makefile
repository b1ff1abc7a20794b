# One-word entry points; see README.md and CONTRIBUTING in the README.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint proto install clean certs soak

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,mpi]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/collective launch --workers 3

test: $(STAMP)
	bash scripts/install-test-deps.sh
	$(PY) -m pytest -q

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
