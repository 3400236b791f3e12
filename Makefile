# The two commands: `make serve` (set-up included) and `make test`.
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
PY := .venv/bin/python

.PHONY: setup serve test unit bench-engine compare clean

setup:
	@scripts/setup.sh

serve: setup
	$(PY) scripts/serve.py --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

test: setup
	$(PY) -m pytest tests -q -p no:cacheprovider --durations=25

unit: setup
	$(PY) -m pytest tests/unit -q -p no:cacheprovider

bench-engine: setup
	$(PY) scripts/bench_engine.py

# The measured comparison of the three strategies (25 to 40 min on 2 cores); results/compare/, and the
# table and plots copied to docs/results/. COMPARE_ARGS="--lock-file /tmp/x.lock" to share the CPU.
compare: setup
	$(PY) scripts/compare.py --out results/compare --publish docs/results $(COMPARE_ARGS)

clean:
	rm -rf .venv .triton .cache models results
