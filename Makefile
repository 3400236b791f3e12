# The two commands: `make serve` (set-up included) and `make test`.
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
PY := .venv/bin/python

.PHONY: setup serve test unit bench-engine clean

setup:
	@scripts/setup.sh

serve: setup
	$(PY) scripts/serve.py --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

test: setup
	$(PY) -m pytest tests -q -p no:cacheprovider

unit: setup
	$(PY) -m pytest tests/unit -q -p no:cacheprovider

bench-engine: setup
	$(PY) scripts/bench_engine.py

clean:
	rm -rf .venv .triton .cache models results
