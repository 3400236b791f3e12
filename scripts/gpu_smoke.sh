#!/usr/bin/env bash
# The whole GPU path in a few minutes, on a machine with an NVIDIA GPU: build the TensorRT-LLM engine for
# the default checkpoint, serve all five models, send continuous_batching_trtllm a greedy, a streamed, a
# stop-string and a cancelled request, run a short benchmark of continuous_batching_trtllm against
# continuous_batching (both on the GPU), and print a one-screen report.
#
#   scripts/gpu_smoke.sh      # on a host with Docker: runs the image $IMAGE (docker/trtllm/Dockerfile)
#   docker run --rm --gpus all --shm-size=2g --ulimit memlock=-1 --ulimit stack=67108864 \
#       batchlm-trtllm scripts/gpu_smoke.sh          # inside the image: serves in place
#
# No GPU: prints "skipped: no GPU" and exits 0. A driver older than docker/versions.env's DRIVER_MIN, or a
# failed step: exit 1, and the report names the step.
# Environment: IMAGE (batchlm-trtllm), SMOKE_READY_TIMEOUT (s to wait for the server, engine build
# included; 1200), SMOKE_REQUESTS (requests per benchmark run; 64), SMOKE_CONCURRENCY (16).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=../docker/versions.env
source docker/versions.env
IMAGE="${IMAGE:-batchlm-trtllm}"
READY_TIMEOUT="${SMOKE_READY_TIMEOUT:-1200}"
REQUESTS="${SMOKE_REQUESTS:-64}"
CONCURRENCY="${SMOKE_CONCURRENCY:-16}"

say() { printf '[gpu_smoke] %s\n' "$*" >&2; }

# 1. A GPU, and a driver that can run the image's CUDA.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! gpus="$(nvidia-smi --query-gpu=name,driver_version,compute_cap \
      --format=csv,noheader 2>/dev/null)" || [[ -z "$gpus" ]]; then
  echo "skipped: no GPU (nvidia-smi found none); nothing was run"
  exit 0
fi
driver="$(head -1 <<<"$gpus" | cut -d, -f2 | tr -d ' ')"
if (( ${driver%%.*} < DRIVER_MIN )); then
  echo "FAIL: NVIDIA driver $driver; the image (CUDA $CUDA_VERSION) needs $DRIVER_MIN or later (docker/versions.env)"
  exit 1
fi

# 2. The server: in this image, or in a container of $IMAGE.
log="$(mktemp)"
if [[ -d /opt/tritonserver/backends/tensorrtllm && -x .venv/bin/python ]]; then
  mode="in the image"
  .venv/bin/python scripts/serve_trtllm.py --device cuda >"$log" 2>&1 &
  server_pid=$!
  run_in() { "$@"; }
  alive() { kill -0 "$server_pid" 2>/dev/null; }
  server_log() { tail -n 25 "$log"; }
  stop_server() { kill -TERM "$server_pid" 2>/dev/null && wait "$server_pid" || true; }
else
  command -v docker >/dev/null || { echo "FAIL: neither inside the image nor a docker command here"; exit 1; }
  docker image inspect "$IMAGE" >/dev/null 2>&1 || {
    echo "FAIL: no image $IMAGE; build it: docker build -f docker/trtllm/Dockerfile -t $IMAGE ."; exit 1; }
  mode="container of $IMAGE"
  name="batchlm-smoke-$$"
  docker run -d --rm --name "$name" --gpus all --shm-size=2g --ulimit memlock=-1 --ulimit stack=67108864 \
      -v batchlm-engines:/opt/batchlm/engines "$IMAGE" >/dev/null
  run_in() { docker exec -i "$name" "$@"; }
  alive() { [[ "$(docker inspect -f '{{.State.Running}}' "$name" 2>/dev/null)" == true ]]; }
  server_log() { docker logs --tail 25 "$name" 2>&1; }
  stop_server() { docker stop -t 90 "$name" >/dev/null 2>&1 || true; }
fi
trap 'stop_server; rm -f "$log"' EXIT

say "serving ($mode); the first start builds the engine"
start=$SECONDS
ready_probe="import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=4)"
until run_in .venv/bin/python -c "$ready_probe" 2>/dev/null; do
  if ! alive || (( SECONDS - start > READY_TIMEOUT )); then
    echo "FAIL: the server was not ready after $((SECONDS - start)) s; its log ends:"
    server_log
    exit 1
  fi
  sleep 5
done
ready_s=$((SECONDS - start))

# 3. The requests, with the project's client inside the image.
checks="$(run_in .venv/bin/python - <<'PY' || true
import time
import requests
from batchlm_client.triton_llm import LLMClient

llm = LLMClient("127.0.0.1:8000", "127.0.0.1:8001", timeout=120)
M, PROMPT = "continuous_batching_trtllm", "Once upon a time"


def greedy():
    a, b = (llm.generate(M, PROMPT, 32, ignore_eos=True) for _ in range(2))
    assert a.text == b.text, "two greedy answers differ"
    assert a.finish_reason == "length" and a.num_output_tokens == 32, (a.finish_reason, a.num_output_tokens)
    return f"{a.num_output_tokens} tokens in {a.latency:.2f} s"


def streamed():
    whole = llm.generate(M, PROMPT, 32, ignore_eos=True).text
    chunks = list(llm.stream_grpc(M, PROMPT, 32, ignore_eos=True, stream=True))
    assert len(chunks) > 1, f"{len(chunks)} chunk(s)"
    assert "".join(c.text for c in chunks) == whole, "streamed text differs from the whole answer"
    return f"{len(chunks)} chunks, equal to the whole answer"


def stop_string():
    whole = llm.generate(M, PROMPT, 32, ignore_eos=True).text
    stop = next(whole[i:i + 3] for i in range(len(whole) // 3, len(whole) - 3) if whole[i:i + 3].strip())
    got = llm.generate(M, PROMPT, 32, ignore_eos=True, stop=[stop])
    assert got.finish_reason == "stop" and whole.startswith(got.text) and len(got.text) < len(whole), got
    return f"stopped at {stop!r} after {len(got.text)} characters"


def running():
    text = requests.get("http://127.0.0.1:8002/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("batchlm_running_requests{") and f'model="{M}"' in line)


def cancellation():
    stream = llm.stream_grpc(M, PROMPT, 512, ignore_eos=True, stream=True)
    next(stream), next(stream)
    stream.close()  # the client cancels the stream while the engine runs
    deadline = time.time() + 10
    while running() > 0 and time.time() < deadline:
        time.sleep(0.2)
    assert running() == 0, "the engine still runs the cancelled request"
    return "the engine freed the request"


def batchlm_on_cuda():
    got = llm.generate("continuous_batching", PROMPT, 16, ignore_eos=True)
    return f"continuous_batching: {got.num_output_tokens} tokens in {got.latency:.2f} s"


for name, check in [("greedy", greedy), ("streamed", streamed), ("stop string", stop_string),
                    ("cancellation", cancellation), ("batchlm on cuda", batchlm_on_cuda)]:
    start = time.perf_counter()
    try:
        ok, detail = "ok", check()
    except Exception as exc:  # NOTE: every check runs; the report names each failure
        ok, detail = "FAIL", f"{type(exc).__name__}: {exc}"
    print(f"| {name} | {ok} | {time.perf_counter() - start:.1f} | {detail} |")
PY
)"

# 4. The benchmark: the same seeded workload against both continuous models.
bench=""
for model in continuous_batching_trtllm continuous_batching; do
  if out="$(run_in .venv/bin/batchlm-bench run "$model" --protocol grpc --concurrency "$CONCURRENCY" \
        --num-requests "$REQUESTS" --output-cap 128 --out /tmp/gpu_smoke 2>&1)"; then
    bench+="$(grep '^|' <<<"$out")"$'\n'
  else
    bench+="| $model | FAIL: $(tail -n 1 <<<"$out") |"$'\n'
  fi
done

# 5. The report.
echo "== batchlm GPU smoke: Triton $TRITON_RELEASE, TensorRT-LLM $TENSORRT_LLM_VERSION, $mode"
echo "GPU: $(head -1 <<<"$gpus")   ($(wc -l <<<"$gpus") GPU(s))"
echo "ready after ${ready_s} s (engine build included when there was none)"
echo
echo "| check | result | s | detail |"
echo "|---|---|---|---|"
echo "${checks:-| requests | FAIL | - | the checks did not run |}"
echo
echo "benchmark: $REQUESTS requests, $CONCURRENCY in flight, gRPC streams"
printf '%s' "$bench"
if grep -q "FAIL" <<<"$checks$bench" || [[ -z "$checks" ]]; then
  echo "RESULT: FAIL"
  exit 1
fi
echo "RESULT: ok"
