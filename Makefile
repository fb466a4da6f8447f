# Two entry points (see README): `make serve` and `make test`. Each sets up what it needs.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: serve test lint venv oracle-env rknn-env fixtures bench

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/ling3-rknn serve --demo $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test: lint
	$(VENV)/bin/pytest $(ARGS)

# Host-only tools: transformers 5.24.0 on the local CPU torch wheel, used to regenerate
# the committed oracle fixtures and goldens (never needed by `make test`).
ORACLE := .venv-oracle
$(ORACLE)/.installed:
	test -x $(ORACLE)/bin/python || $(PY) -m venv $(ORACLE)
	$(ORACLE)/bin/pip install --quiet torch==2.13.0
	$(ORACLE)/bin/pip install --quiet transformers==5.24.0 safetensors tokenizers jinja2 numpy
	touch $@

oracle-env: $(ORACLE)/.installed
