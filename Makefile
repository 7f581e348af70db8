.PHONY: setup demo test lint bench

setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/roll-backend run configs/grpo_tiny_cpu.yaml

test: setup lint
	.venv/bin/python -m pytest tests

lint: setup
	.venv/bin/ruff format --check .
	.venv/bin/ruff check .

bench: setup
	.venv/bin/python bench/dataproto.py
	.venv/bin/python bench/broadcast.py
	.venv/bin/python bench/grpo_step.py
	.venv/bin/python bench/weight_sync.py
