# Two commands do everything on a fresh machine with Python 3.11:
#   make demo   set up .venv and run the full pipeline on the embedded corpus (preset demo)
#   make test   set up .venv and run the test suite
PYTHON  ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
WORKDIR ?= data/runs/default
# CI adds the sentence-embedding baseline, the JAX backend and the exports:
#   make test EXTRAS=dev,embeddings,jax,export
EXTRAS  ?= dev
comma   := ,
STAMP   := $(VENV)/.installed-$(subst $(comma),-,$(strip $(EXTRAS)))

.PHONY: install demo test lint clean bench

install: $(STAMP)

# Reinstall whenever pyproject.toml or the requested extras change; pip resolves only what is missing.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[$(strip $(EXTRAS))]"
	@touch $(STAMP)

demo: install
	$(BIN)/selfsup run --corpus pydocs --preset demo --workdir $(WORKDIR)
	$(BIN)/selfsup report --workdir $(WORKDIR)

# Two workers by default (the CI machine's cores); JOBS=0 runs in this process, one test at a time.
JOBS    ?= 2

test: install
	$(BIN)/python -m pytest -q $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadscope)

lint: install
	$(BIN)/ruff check flows tasks selfsup_model tests benchmarks

bench: install
	$(BIN)/python benchmarks/masking.py
	$(BIN)/python benchmarks/dedup.py
	$(BIN)/python benchmarks/pretrain.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
