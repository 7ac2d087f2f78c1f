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

.PHONY: help setup serve test test-all browser-deps data train-default train-shipped eval-default bench clean

help:
	@echo "make serve         set up .venv and serve the default model on http://$(HOST):$(PORT)"
	@echo "make test          set up .venv (and headless chromium) and run the test suite"
	@echo "make data          generate the scene dataset in $(DATA)"
	@echo "make train-default retrain the shipped SAT checkpoint (weights/sat-scenes)"
	@echo "make train-NAME    retrain, evaluate and card one checkpoint (NAME: $(SHIPPED) xtransformer sat-hard)"
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

data: $(DATA)/dataset_scenes.json

# made once: the generator is deterministic, and training runs read (and cache features of) these files
$(DATA)/dataset_scenes.json: | $(STAMP)
	$(BIN)/captioner data generate --out $(DATA)

# The shipped checkpoints: folder name under weights/ → `captioner train` arguments. `make train-NAME` retrains one
# exactly as its MODEL_CARD.md records (1 thread: faster than 2 on a shared 2-core machine), evaluates it on the
# test and held-out splits, writes the card from those measurements and installs it in weights/.
ZOO_BUDGET := --epochs 1 --train-limit 2000
SCENE_SAT := --set embed_dim=256 --set hidden_dim=512 --set attn_dim=256
SCENE_SPARSECAP := --model sparsecap --epochs 1 --set embed_dim=256 --set hidden_dim=512 --set visual_dim=256 \
  --set attn_dim=256
# the default: hypercolumns on a 16×16 grid, a lighter doubly stochastic penalty, ×0.1 learning rate for the last two
# epochs, best epoch by validation objects_named (docs/decisions.md, "The default checkpoint")
TRAIN_sat-scenes := --model sat --epochs 7 --lr-drop 5 --encoder layer=hypercolumn --encoder grid_stride=16 \
  $(SCENE_SAT) --set doubly_stochastic=0.1 --select-metric objects_named
TRAIN_sparsecap-tvmax := $(SCENE_SPARSECAP) --attention tvmax
TRAIN_sparsecap-softmax := $(SCENE_SPARSECAP) --attention softmax
TRAIN_aoanet := $(ZOO_BUDGET) --model aoanet --set d_model=256 --set embed_dim=256 --set ffn_dim=1024
TRAIN_xlan := $(ZOO_BUDGET) --model xlan --set dim=256 --set hidden_dim=256 --set embed_dim=256 --set channel_dim=128
SHIPPED := sat-scenes sparsecap-tvmax sparsecap-softmax aoanet xlan

# Not shipped, trained for the model-zoo table (docs/model_zoo.md) on the same budget as aoanet and xlan.
TRAIN_xtransformer := $(ZOO_BUDGET) --model xtransformer --set dim=256 --set channel_dim=128 --set ffn_dim=1024
TRAIN_sat-hard := $(ZOO_BUDGET) --model sat-hard $(SCENE_SAT)
# Not shipped either: the sparsemax row of the softmax / sparsemax / TVmax figure (docs/heatmaps.md).
TRAIN_sparsecap-sparsemax := $(SCENE_SPARSECAP) --attention sparsemax

train-default: train-sat-scenes

train-shipped: $(addprefix train-,$(SHIPPED))

train-%: data
	@test -n "$(TRAIN_$*)" || { echo "no recipe TRAIN_$* in the Makefile"; exit 2; }
	$(BIN)/captioner train $(TRAIN_$*) --dataset $(DATA) --out runs/$* --threads 1
	$(BIN)/captioner eval runs/$*/best --dataset $(DATA) --split test --split heldout --threads 1 \
	  --output runs/$*/eval.json
	$(BIN)/captioner card runs/$*/best --report runs/$*/eval.json --title "$*"
	@if [[ " $(SHIPPED) " == *" $* "* ]]; then \
	  rm -rf weights/$*.new && cp -r runs/$*/best weights/$*.new && rm -rf weights/$* && mv weights/$*.new weights/$*; \
	  echo "installed weights/$*"; fi

eval-default: data
	$(BIN)/captioner eval weights/sat-scenes --dataset $(DATA) --split test --split heldout

bench: $(STAMP)
	@for script in benchmarks/bench_*.py; do echo "== $$script"; $(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) .cache runs .pytest_cache
