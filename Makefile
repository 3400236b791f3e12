# The two commands: `make serve` (set-up included) and `make test`.
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
# The OpenAI-compatible frontend next to Triton (127.0.0.1 only); FRONTEND_PORT=0 or NO_FRONTEND=1: none.
# Its API key comes only from the environment, BATCHLM_API_KEY=... make serve, which batchlm-serve reads:
# as a make variable it would be on batchlm-serve's command line.
FRONTEND_PORT ?= 9000
NO_FRONTEND ?=
# Another checkpoint for every model (a llama GGUF file or a Hugging Face Llama folder); empty: each
# config.pbtxt's model_dir, SmolLM2-135M-Instruct.
MODEL ?=
PY := .venv/bin/python
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

.PHONY: setup serve test test-slow unit bench-engine bench-peers bench-peers-served bench-prefix compare eval clean

setup:
	@scripts/setup.sh

serve: setup
	.venv/bin/batchlm-serve --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		--frontend-port $(if $(NO_FRONTEND),0,$(FRONTEND_PORT)) $(if $(MODEL),--model $(MODEL),)

# The contract suite: unit tests and functional tests against a real tritonserver.
test: setup
	$(PYTEST) tests -m "not slow" --durations=15

# Characterization runs that assert no contract (longer served benchmarks, repeated stops).
test-slow: setup
	$(PYTEST) tests -m slow --durations=15

unit: setup
	$(PYTEST) tests/unit -m "not slow"

bench-engine: setup
	.venv/bin/batchlm-bench engine

# The engine next to transformers (continuous batching and generate), CTranslate2 and llama.cpp on one
# seeded workload, on the default model (~30 min on 2 cores; PEERS_ARGS="--num-requests 32": ~16 min):
# results/peers/. Installs the `peers` extra first (llama-cpp-python compiles from source the first time,
# ~5.5 min). PEERS_ARGS="--engines batchlm,ct2" to run fewer.
bench-peers: setup
	.venv/bin/pip install -q -e '.[peers]'
	.venv/bin/batchlm-bench peers $(PEERS_ARGS)

# Served vs served: continuous_batching through Triton and the OpenAI frontend, llama.cpp's llama-server on
# the Q4_1 file and a Q8_0 one, OpenVINO GenAI (in process) on a float32 IR and on the GGUF file, and the
# project's engine in process beside it, at 1, 8 and 32 streams (~15 min on 2 cores): results/peers_served/. Installs the `peers-served` extra, builds
# llama-server once (~10-20 min) and installs optimum-intel apart (docs/benchmarking.md, "Served vs served").
# PEERS_SERVED_ARGS="--servers triton,llama-q4_1" to run fewer.
bench-peers-served: setup
	.venv/bin/pip install -q -e '.[peers-served]'
	scripts/build_llama_server.sh
	scripts/install_optimum_intel.sh
	.venv/bin/batchlm-bench peers-served $(PEERS_SERVED_ARGS)

# Prefix caching on and off, one server at a time, on multi-turn chat, a shared system prompt and prompts
# sharing nothing (about 8 min on 2 idle cores): results/prefix_cache/.
# PREFIX_ARGS="--model dynamic_batching" for another strategy (docs/benchmarking.md, "Prefix caching").
bench-prefix: setup
	.venv/bin/batchlm-bench prefix $(PREFIX_ARGS)

# The measured comparison of the three strategies on the chat workload (COMPARE_ARGS="--repeats 1":
# 21 min on 2 cores; the default 3 rounds repeat the saturation runs): results/compare/, and the
# table and plots copied to docs/results/. COMPARE_ARGS="--lock-file /tmp/x.lock" to share the CPU.
compare: setup
	.venv/bin/batchlm-bench compare --out results/compare --publish docs/results $(COMPARE_ARGS)

# lm-evaluation-harness on the project's quiz (batchlm/eval/tasks/): its Hugging Face backend on the default
# model's file, then the served continuous_batching through the OpenAI frontend (a server of its own on free
# ports), compared item by item: results/eval/comparison.md. Installs the `eval` extra first where lm-eval
# is missing. EVAL_ARGS="--url http://127.0.0.1:9000" asks a running `make serve` instead.
eval: setup
	@$(PY) -c "import lm_eval" 2>/dev/null || .venv/bin/pip install -q -e '.[eval]'
	.venv/bin/batchlm-bench eval $(EVAL_ARGS)

clean:
	rm -rf .venv .triton .cache models results
