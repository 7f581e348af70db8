.PHONY: setup demo test lint bench

setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/roll-backend run configs/grpo_tiny_cpu.yaml

# Two pytest workers, each with its own Ray, each taking whole modules (tests/conftest.py says why and in what order):
# one worker alone leaves a 2-core machine ~40% idle (a pipeline step waits on one rank at a time).
TEST_WORKERS ?= 2

test: setup lint
	.venv/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder tests

lint: setup
	.venv/bin/ruff format --check .
	.venv/bin/ruff check .

bench: setup
	.venv/bin/python bench/dataproto.py
	.venv/bin/python bench/broadcast.py
	.venv/bin/python bench/grpo_step.py
	.venv/bin/python bench/weight_sync.py
