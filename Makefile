.PHONY: setup demo test lint bench

setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/roll-backend run configs/grpo_tiny_cpu.yaml

# TEST_WORKERS=2: two pytest workers, each with its own Ray, each taking whole modules (tests/conftest.py). On 2 cores
# it cut the suite from ~45 to 34 min, but two workers' ranks can exceed 24 GB (Ray's memory monitor then kills
# ranks): one worker stays the default until the heavy scopes are kept apart (README, "The test suite").
TEST_WORKERS ?= 1
PARALLEL_TEST_ARGS = $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)

test: setup lint
	.venv/bin/python -m pytest $(PARALLEL_TEST_ARGS) tests

lint: setup
	.venv/bin/ruff format --check .
	.venv/bin/ruff check .

bench: setup
	.venv/bin/python bench/dataproto.py
	.venv/bin/python bench/broadcast.py
	.venv/bin/python bench/grpo_step.py
	.venv/bin/python bench/weight_sync.py
