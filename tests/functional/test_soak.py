"""A 60-second soak against the shared server: Locust at saturation on all three models at once (three
transports), no failed request, and the server's memory, descriptors and threads flat within the bounds
`batchlm-bench soak` checks. The E2E p99 drift is reported, not bounded here: over one minute it is a
latency ratio that moves with the CPU and what else runs on it. The long run is `batchlm-bench soak`,
which bounds it (docs/operations.md, "Reliability")."""

import json
import subprocess
import sys

from batchlm.paths import PROJECT_ROOT
from tests.functional.conftest import locust_events

PROTOCOLS = {"static_batching": "http", "dynamic_batching": "infer", "continuous_batching": "grpc"}

DURATION_S = 60


def test_a_minute_at_saturation_on_every_model_fails_nothing_and_leaks_nothing(server, tmp_path):
    out = tmp_path / "soak"
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "soak", "--duration", str(DURATION_S),
                           "--interval", "2", "--max-p99-drift", "0",
                           "--http", server.http_url, "--grpc", server.grpc_url,
                           "--server-pid", str(server.process.pid), "--out", str(out)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=DURATION_S + 240)
    report = json.loads((out / "soak.json").read_text())
    assert proc.returncode == 0, f"{report['broken']}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert not report["broken"]
    for model, m in report["models"].items():
        assert m["requests"] >= 16, (model, m)  # it was loaded: every model answered two batches at least
        assert m["failures"] == 0, (model, m["failure_kinds"])
    assert len(report["samples"]) >= DURATION_S // 2
    # each Locust user reported both events, with output tokens as their size; the streamed model's first
    # token came well before its last; and the Locust table reads the run's CSV
    for model, protocol in PROTOCOLS.items():
        rows = locust_events(out / model)
        assert set(rows) == {f"TTFT {protocol} {model}", f"E2E {protocol} {model}"}, rows
        assert all(float(row["Average Content Size"]) > 0 for row in rows.values()), rows
    streamed = locust_events(out / "continuous_batching")
    assert float(streamed["TTFT grpc continuous_batching"]["Average Response Time"]) < \
        float(streamed["E2E grpc continuous_batching"]["Average Response Time"])
    table = subprocess.run([sys.executable, "-m", "batchlm.bench", "locust-table",
                            *(str(out / f"{model}_stats.csv") for model in PROTOCOLS)],
                           cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and all(f"| `{model}` | {protocol} | E2E |" in table.stdout
                                         for model, protocol in PROTOCOLS.items()), table.stdout + table.stderr
