# Set-up, tests and the demo. `make test` and `make demo` install first when .venv is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# The pinned working set. torchrec is installed with --no-deps because it names the CUDA fbgemm-gpu as
# a dependency; its real dependencies are listed here instead, with the fbgemm build that fits the machine.
HAS_NVIDIA_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
FBGEMM   := $(if $(HAS_NVIDIA_GPU),fbgemm-gpu==1.8.0,fbgemm-gpu-cpu==1.8.0)
PINNED   := torch==2.13.0 $(FBGEMM) triton==3.7.1 tensordict torchmetrics==1.0.3 tqdm pyre-extensions
RUNTIME  := numpy onnx onnxruntime onnxscript click rich jinja2 safetensors model-signing==1.1.1 pyopenssl
DEV      := pytest pytest-timeout hypothesis ruff jsonschema
# The serving tests run a real Triton Inference Server: the tritonserver nvidia-pytriton bundles (its binary
# only), called with tritonclient's HTTP and gRPC clients. Both are installed with --no-deps (below);
# TRITON_CLIENT_DEPS are tritonclient[http,grpc]'s dependencies less its pins protobuf<7 and ml-dtypes<=0.5.4,
# which would downgrade the versions onnx brings (its clients work with them: tests/test_triton_server.py).
TRITON   := nvidia-pytriton==0.7.0 tritonclient==2.73.0
TRITON_CLIENT_DEPS := 'grpcio>=1.81.1' 'geventhttpclient>=2.3.3' 'greenlet<3.4' python-rapidjson

DEMO_DIR ?= out/demo

.PHONY: install system-tools test test-fast demo lint clean cpp-runtime

install: $(STAMP)

# System tools the tests use: cmake and a C++ compiler (the C++ runtime, runtimes/cpp), graphviz (SVG
# graph dumps) and chromium (the report opened in a real browser). Installed with apt-get when running as
# root; otherwise graph dumps fall back to .dot files and the browser test is skipped, as the product
# itself does without them, and the C++ runtime tests fail naming what is missing.
SYSTEM_TOOLS := cmake:cmake c++:g++ dot:graphviz chromium:chromium
system-tools:
	@missing=""; for pair in $(SYSTEM_TOOLS); do \
	  command -v "$${pair%%:*}" >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing$$missing (apt-get)"; \
	    (DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null && \
	     DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null) || \
	    echo "note: apt-get failed; missing:$$missing"; \
	  else \
	    echo "note: missing$$missing (not root, no apt-get): graph dumps fall back to .dot, the browser test is skipped, the C++ runtime tests fail"; \
	  fi; \
	fi

$(STAMP): pyproject.toml Makefile
	@$(MAKE) --no-print-directory system-tools
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(PINNED) $(RUNTIME) $(DEV) $(TRITON_CLIENT_DEPS)
	$(BIN)/python -m pip install -q --no-deps torchrec==1.8.0
	# --no-deps: tritonclient's pins would downgrade protobuf and ml-dtypes; pytriton's Python API (not used
	# here) pins numpy<2.
	$(BIN)/python -m pip install -q --no-deps $(TRITON)
	# Dependencies are all in place above; --no-deps keeps pip from pulling the CUDA fbgemm-gpu via torchrec.
	$(BIN)/python -m pip install -q --no-deps -e '.[dev]'
	touch $@

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# Build the tiny model, export it with AOTInductor on CPU (verified against eager), print the summary.
demo: $(STAMP)
	$(BIN)/python examples/build_model.py --preset tiny -o $(DEMO_DIR)/model.pt
	$(BIN)/hstu-export describe $(DEMO_DIR)/model.pt
	$(BIN)/hstu-export $(DEMO_DIR)/model.pt --backend aoti --device cpu --max-batch-size 16 \
		--out $(DEMO_DIR)/model.aoti --dump-graphs $(DEMO_DIR)/graphs --force
	$(BIN)/hstu-export run $(DEMO_DIR)/model.aoti --batch $(DEMO_DIR)/model.pt

# The C++ runtime (runtimes/cpp) against this environment's torch: build/cpp/hstu-export-run and
# build/cpp/libhstu_export_runtime.so.
cpp-runtime: $(STAMP)
	PYTHON=$(BIN)/python runtimes/cpp/build.sh build/cpp

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) out build .pytest_cache .ruff_cache
