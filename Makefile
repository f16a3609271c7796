# The README's two commands: `make demo` (set up, run the main job on real photos) and `make test`
# (set up, pass the tests). Both work from a fresh clone; each step below is idempotent.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# This machine cannot download weights: the demo selects seeded random weights explicitly unless
# told otherwise, e.g. `make demo CLIP_PRETRAINED=laion2b_s34b_b79k` or a checkpoint file path.
CLIP_PRETRAINED ?= random
FOLDER ?= samples

.PHONY: setup demo test test-e2e run bench procfile clean

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $(STAMP)

# A private secret key for this checkout (production reads DJANGO_SECRET_KEY from its environment).
.env:
	$(PYTHON) -c "import secrets; print('DJANGO_SECRET_KEY=' + secrets.token_urlsafe(50))" > .env

setup: $(STAMP) .env

demo: setup
	CLIP_PRETRAINED=$(CLIP_PRETRAINED) $(PY) -m scripts.demo $(FOLDER)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-e2e: setup
	$(PY) -m pytest tests/e2e $(PYTEST_ARGS)

run: setup
	$(PY) -m scripts.stack

procfile:
	$(PYTHON) -m project.processes > Procfile

clean:
	rm -rf var .pytest_cache
