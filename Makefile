.PHONY: setup demo test bench

setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/roll-backend run configs/grpo_tiny_cpu.yaml

test: setup
	.venv/bin/python -m pytest tests

bench: setup
	.venv/bin/python bench/dataproto.py
	.venv/bin/python bench/broadcast.py
	.venv/bin/python bench/grpo_step.py
