# Two commands for a fresh machine (see README): `make demo` and `make test`. Both create .venv first.
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/posttrain/torch_extensions

EXTRAS ?= dev
.PHONY: setup demo test test-fast test-distributed bench bench-check
setup:
	POSTTRAIN_EXTRAS=$(EXTRAS) bash scripts/setup.sh

demo: setup
	.venv/bin/posttrain demo

# the 2-process tests one at a time, then the rest on two workers (tests/conftest.py keeps vLLM and Ray on one)
test: setup
	.venv/bin/python -m pytest tests/distributed -q; first=$$?; \
	.venv/bin/python -m pytest tests -q --ignore=tests/distributed -n 2 --dist loadgroup; exit $$(( first || $$? ))

test-fast: setup
	.venv/bin/python -m pytest tests -q --ignore=tests/distributed -n 2 --dist loadgroup

test-distributed: setup
	.venv/bin/python -m pytest tests -q -m distributed

# posttrain / TRL ratios (trained forward tokens, peak memory, CPU time) against bench/baselines/*.json: fails on one
# more than 10% worse (bench/bench_check.py; `--write` measures new baselines)
bench-check: setup
	.venv/bin/python bench/bench_check.py
