PY ?= python3

.PHONY: install demo test lint bench

install:
	@bash scripts/install.sh

demo: install
	$(PY) -m embtables train --model-dir demo_out

test: install
	$(PY) -m pytest tests -n auto --dist worksteal

lint: install
	$(PY) -m ruff check embtables tests benchmarks examples scripts
	$(PY) -m mypy

bench: install
	$(PY) -m embtables bench
