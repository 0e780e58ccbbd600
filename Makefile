# Two commands do all setup on a fresh machine with Python 3.11 and pip:
#   make demo   builds .venv and runs `leaplm generate --compare` on the embedded model family: a held-out
#               function's opening (examples/demo-prompt.txt), plain decoding and the draft side by side
#   make test   builds .venv and runs the test suite
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch (on this class of machine pip finds it locally); override for CUDA/MPS.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# llama-cpp-python (the llamacpp extra) is a source distribution: pip builds libllama with CMake. leaplm loads
# libllama and ggml only, so the multimodal library is not built (examples, tools, tests and server are off too).
LLAMACPP_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_SERVER=OFF

.PHONY: demo test test-all bench setup clean reliability test-ray

$(BIN)/leaplm: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(BIN)/pip install -q -e ".[test,llamacpp]"
# the int8 kernel's C++ library, compiled here once rather than in the first command that needs it
# (load() falls back to the PyTorch path, with a warning, where it cannot be built)
	$(BIN)/python -c "from leaplm.kernels.build import load; load()"
	touch $(BIN)/leaplm

setup: $(BIN)/leaplm

demo: setup
	$(BIN)/leaplm generate --compare --threads 1 --max-new-tokens 96 < examples/demo-prompt.txt

test: setup
	$(BIN)/python -m pytest -q -m "not slow" tests

test-all: setup
	$(BIN)/python -m pytest -q tests

# The reliability suite with its long variants (marked soak: soaks of SOAK_SECONDS, default 300, and abort storms
# of ABORTS, default 100, on SmolLM2's GGUF file through the int8 kernel and libllama). The documented run is
# `ABORTS=1000 SOAK_SECONDS=1800 make reliability`; its figures are printed and written to reliability-report.json
# (docs/reliability.md quotes them).
reliability: setup
	OMP_NUM_THREADS=1 SOAK_SECONDS=$${SOAK_SECONDS:-300} ABORTS=$${ABORTS:-100} \
		RELIABILITY_REPORT=$${RELIABILITY_REPORT:-reliability-report.json} \
		$(BIN)/python -m pytest -q -m "not slow or soak" tests/reliability

# Ray Serve scale-out (two replicas on this machine, about two minutes): installs the ray extra, and a missing
# ray fails instead of skipping.
test-ray: setup
	$(BIN)/pip install -q -e ".[ray]"
	OMP_NUM_THREADS=1 LEAPLM_REQUIRE_RAY=1 $(BIN)/python -m pytest -q tests/deploy/test_ray_serve.py

bench: setup
	$(BIN)/leaplm bench --baselines hf

clean:
	rm -rf $(VENV) build *.egg-info
