# Two commands do all set-up on a fresh machine:
#   make train   install, then `zeroshard train`: a small Llama on 2 processes with ZeRO-3 on the bundled data
#   make test    install, then run the default test suite (what CI runs)
PYTHON ?= python
PIP = $(PYTHON) -m pip

.PHONY: install train example test test-all lint bench

install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,hf]'

train: install
	zeroshard train --nproc-per-node 2

example: install
	$(PYTHON) -m torch.distributed.run --standalone --nproc_per_node 2 examples/train_gpt.py

test: install
	$(PYTHON) -m pytest -q

test-all: install
	$(PYTHON) -m pytest -q -m ''

lint:
	ruff check src tests benchmarks examples
	mypy src
