# Two commands do all set-up on a fresh machine:
#   make train   install, then `zeroshard train`: a small Llama on 2 processes with ZeRO-3 on the bundled data
#   make test    install, plus DeepSpeed as the parity reference, then run the default test suite (what CI runs)
PYTHON ?= python
PIP = $(PYTHON) -m pip

.PHONY: install install-compat train example test test-all test-gpu overlap-gpu lint

install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,hf]'

# DeepSpeed, the reference of the parity tests (tests only), goes in after torch so pip keeps that torch. Of its
# C++ ops the tests use two, built here against that torch (about 5 minutes, once per environment): FusedAdam (its
# CPU optimizer for a config's "Adam"/"AdamW") and the shared-memory comm op that `deepspeed.init_distributed`
# loads on CPU. Unbuilt, DeepSpeed JIT-compiles each (~75 s) inside the first test that needs it, in every fresh
# environment. --no-build-isolation lets its setup.py see torch; --no-cache-dir keeps pip from reusing a wheel it
# built without ops. The version is the compat extra's pin. The monitor extra (tensorboard, wandb) lets the tests
# read back what those config blocks write; the trl extra lets the SFTTrainer test run.
DEEPSPEED = deepspeed==0.19.8
install-compat: install
	$(PIP) install -q setuptools wheel
	DS_BUILD_OPS=0 DS_BUILD_FUSED_ADAM=1 DS_BUILD_SHM_COMM=1 \
		$(PIP) install -q --no-build-isolation --no-cache-dir '$(DEEPSPEED)'
	DS_BUILD_OPS=0 $(PIP) install -q -e '.[compat,monitor,trl]'

train: install
	zeroshard train --nproc-per-node 2 --save-steps 100

example: install
	$(PYTHON) -m torch.distributed.run --standalone --nproc_per_node 2 examples/train_gpt.py

test: install-compat
	$(PYTHON) -m pytest -q

test-all: install-compat
	$(PYTHON) -m pytest -q -m ''

# The GPU suite (issue 13) on a CUDA machine, at world size 1 (and 2 with two GPUs). No install step: GPU machines
# here have torch, transformers and peft but no package registry, so the tree runs from src/ as it is.
test-gpu:
	PYTHONPATH=src $(PYTHON) -m pytest tests/gpu -m cuda -q -rfE -p no:cacheprovider

# Issue 13 item 4: one stage-3 step and one offloaded step profiled; exposed-communication fractions in one call.
overlap-gpu:
	PYTHONPATH=src:. $(PYTHON) -m benchmarks.overlap --json overlap.json

lint:
	ruff check src tests benchmarks examples
	ruff format --check src tests benchmarks examples
	mypy src
