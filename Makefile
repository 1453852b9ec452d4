# Tasks for the edit-test loop and CI. `make help` lists them.
PYTHON ?= python

.PHONY: help install test test-all lint typecheck imports check benchmark benchmark-quick docs

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

install:  ## install the package with its dev tools (the README's install command)
	$(PYTHON) -m pip install -e ".[dev]"

test:  ## the fast test set (the default: slow TensorFlow, Chromium and cluster cases left out)
	$(PYTHON) -m pytest -q

test-all:  ## every test, as CI runs them (over two processes: pytest-xdist)
	$(PYTHON) -m pytest -q --all -n 2 --dist loadgroup

lint:  ## ruff
	ruff check .

typecheck:  ## mypy, strict
	mypy

imports:  ## the import rules of ARCHITECTURE.md
	lint-imports

check: lint typecheck imports test  ## everything a commit should pass

benchmark-quick:  ## the zoo benchmark, quick mode (prints a table, writes JSON)
	$(PYTHON) -m benchmarks.run --quick --json /tmp/partitioner-zoo-quick.json

benchmark:  ## the full zoo benchmark: regenerates benchmarks/results/ (then `make docs`)
	$(PYTHON) -m benchmarks.run --json benchmarks/results/zoo.json --table benchmarks/results/zoo.txt \
		--readme benchmarks/results/README_section.md \
		--measured benchmarks/results/cluster_pipeline.json --measured benchmarks/results/cluster_zoo.json

docs:  ## regenerate the README's generated parts: the solver table (registry) and the benchmark section
	$(PYTHON) -m benchmarks.readme
