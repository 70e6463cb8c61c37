# Two commands do all the set-up: `make run` and `make test`. Both install first if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# On a machine without CUDA take the CPU build of torch (a wheel of it may already lie on disk);
# an unpinned torch would pull a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0
STAMP := $(VENV)/.installed
export RAY_AUTH_MODE ?= disabled

.PHONY: install run test demo clean k8s-config

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install --quiet -e '.[test]'; \
	else \
		$(PIP) install --quiet '$(TORCH_CPU)' && $(PIP) install --quiet -e '.[test]' '$(TORCH_CPU)'; \
	fi
	touch $(STAMP)

CONFIG ?= configs/demo.yaml

# Ray with the dashboard on 127.0.0.1:8265 and metrics on :8080, then the app; Ctrl-C stops both.
run: install
	./scripts/serve.sh $(CONFIG)

demo: install
	$(PY) -m engine.demo

test: install
	$(PY) -m pytest tests -q

# k8s/rayservice.yaml's serveConfigV2 from configs/gpu-llama.yaml (tests/k8s/ fails while they differ).
k8s-config: install
	$(PY) k8s/sync_serve_config.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
