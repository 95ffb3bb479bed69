# Two commands for a fresh machine (see README): `make demo` and `make test`. Both create .venv first.
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/posttrain/torch_extensions

EXTRAS ?= dev
.PHONY: setup demo test test-fast test-distributed bench
setup:
	POSTTRAIN_EXTRAS=$(EXTRAS) bash scripts/setup.sh

demo: setup
	.venv/bin/posttrain demo

test: setup
	.venv/bin/python -m pytest tests -q

test-fast: setup
	.venv/bin/python -m pytest tests -q -m "not distributed"

test-distributed: setup
	.venv/bin/python -m pytest tests -q -m distributed
