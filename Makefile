# Everything a newcomer needs: `make serve` (set up + serve the default model), `make test` (set up + tests).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
DATA := .cache/scenes
PYTEST_ARGS ?=

.PHONY: help setup serve test test-all browser-deps data train-default eval-default bench clean

help:
	@echo "make serve         set up .venv and serve the default model on http://$(HOST):$(PORT)"
	@echo "make test          set up .venv (and headless chromium) and run the test suite"
	@echo "make data          generate the scene dataset in $(DATA)"
	@echo "make train-default retrain the shipped SAT checkpoint (weights/sat-scenes)"
	@echo "make eval-default  evaluate the shipped checkpoint on the test and held-out splits"
	@echo "make bench         run the benchmarks and write their tables to docs/benchmarks/"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

setup: $(STAMP)

serve: $(STAMP)
	$(BIN)/captioner serve --host $(HOST) --port $(PORT)

# Debian's chromium drives the browser test; installed when we may (root + apt), otherwise that test skips.
browser-deps:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "warning: could not install chromium; the browser test will be skipped"; \
	else echo "note: chromium not installed and not root; the browser test will be skipped"; fi

test: $(STAMP) browser-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

data: $(STAMP)
	$(BIN)/captioner data generate --out $(DATA)

train-default: data
	$(BIN)/captioner train --model sat --dataset $(DATA) --out runs/sat-scenes --epochs 4 \
	  --set embed_dim=256 --set hidden_dim=512 --set attn_dim=256
	rm -rf weights/sat-scenes.new && cp -r runs/sat-scenes/best weights/sat-scenes.new
	cp weights/sat-scenes/MODEL_CARD.md weights/sat-scenes.new/ 2>/dev/null || true
	rm -rf weights/sat-scenes && mv weights/sat-scenes.new weights/sat-scenes

eval-default: data
	$(BIN)/captioner eval weights/sat-scenes --dataset $(DATA) --split test --split heldout

bench: $(STAMP)
	@for script in benchmarks/bench_*.py; do echo "== $$script"; $(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) .cache runs .pytest_cache
