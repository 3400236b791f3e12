"""A short serving benchmark against the real server: every strategy, JSON, markdown and plots."""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests as http

from batchlm.bench.served import plots
from batchlm.bench.served.arrivals import ArrivalSpec
from batchlm.bench.served.benchmark import BenchmarkConfig, UnmeasurableModel
from batchlm.bench.served.report import measure, write_run
from batchlm.bench.workload import WorkloadSpec, build_requests
from batchlm.launcher.ports import free_port
from batchlm.launcher.processes import process_tree
from batchlm.paths import PROJECT_ROOT
from batchlm_client.cli import main as cli_main
from tests.functional.conftest import is_alive

STRATEGIES = ("static_batching", "dynamic_batching", "continuous_batching")
SPEC = WorkloadSpec(num_requests=8, output_mean=12.0, output_cap=24)  # 8: static needs a full batch


@pytest.fixture(scope="module")
def documents(server, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    requests = build_requests(SPEC)
    docs = {}
    for model in STRATEGIES:
        arrival = ArrivalSpec.closed_loop(8) if model == "static_batching" else ArrivalSpec.open_loop(20.0)
        config = BenchmarkConfig(model, server.http_url, server.grpc_url, server.metrics_url, arrival)
        docs[model] = measure(config, requests, SPEC.as_dict())
        write_run(docs[model], out, model)
    return out, docs, requests


def test_runs_have_no_failures_and_exact_token_counts(documents):
    _, docs, requests = documents
    for model, doc in docs.items():
        summary = doc["summary"]
        assert summary["failures"] == {} and summary["num_ok"] == len(requests), model
        for record, request in zip(doc["requests"], requests):
            assert record["num_output_tokens"] == request.max_tokens
            assert 0 < record["ttft"] <= record["latency"]
        assert summary["output_token_throughput"] > 0
        counted = sum(sample["generated_tokens"] for sample in doc["timeline"])  # the server's own counter
        assert 0 < counted <= sum(r.max_tokens for r in requests), model
        assert summary["e2e"]["p50"] > 0 and summary["e2e"]["p99"] >= summary["e2e"]["p50"]
        assert doc["environment"]["server"]["version"] and doc["model_config"]["name"] == model


def test_streaming_strategy_reports_per_token_timing(documents):
    _, docs, _ = documents
    assert all(doc["protocol"] == "http" for doc in docs.values())  # the default transport
    assert docs["continuous_batching"]["streamed"]
    assert docs["continuous_batching"]["summary"]["itl"]["count"] > 0
    assert not docs["static_batching"]["streamed"] and not docs["dynamic_batching"]["streamed"]
    assert docs["dynamic_batching"]["summary"]["tpot"]["count"] == 0  # one answer: no per-token timing


@pytest.mark.parametrize("stream", [True, False])
def test_grpc_transport_measures_the_same(server, stream):
    requests = build_requests(WorkloadSpec(num_requests=4, output_mean=12.0, output_cap=24))
    config = BenchmarkConfig("continuous_batching", server.http_url, server.grpc_url, None,
                             ArrivalSpec.closed_loop(2), stream=stream, protocol="grpc")
    doc = measure(config, requests, {})
    assert doc["protocol"] == "grpc" and doc["streamed"] is stream
    assert doc["summary"]["failures"] == {} and doc["summary"]["num_ok"] == len(requests)
    assert [r["num_output_tokens"] for r in doc["requests"]] == [r.max_tokens for r in requests]
    assert (doc["summary"]["itl"]["count"] > 0) is stream


def test_a_streamed_grpc_run_leaves_the_model_free_to_unload(server):
    """The benchmark's gRPC streams end without cancelling requests that have ended: cancelling a stream
    whose last response had arrived left tritonserver 2.51 holding the model, and its unload never
    finished (3 of 3 such runs with a client that cancelled every stream at its end)."""
    requests_ = build_requests(WorkloadSpec(num_requests=4, output_mean=12.0, output_cap=24))
    config = BenchmarkConfig("continuous_batching", server.http_url, server.grpc_url, None,
                             ArrivalSpec.closed_loop(2), stream=True, protocol="grpc")
    assert measure(config, requests_, {})["summary"]["num_ok"] == len(requests_)
    before = {pid for pid, model in server.stubs().items() if model == "continuous_batching"}
    repository = f"http://{server.http_url}/v2/repository/models/continuous_batching"
    assert http.post(f"{repository}/unload", headers=server.admin_headers, timeout=60).status_code == 200
    try:
        deadline = time.monotonic() + 15
        while before & set(server.stubs()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not before & set(server.stubs()), "continuous_batching did not unload after the run"
    finally:
        assert http.post(f"{repository}/load", headers=server.admin_headers, timeout=300).status_code == 200


def test_infer_transport_measures_request_level_models_and_refuses_a_decoupled_one(server):
    """HTTP /infer serves the models that are not decoupled; a decoupled one is refused before any
    request is sent, naming the transports that reach it."""
    requests_ = build_requests(WorkloadSpec(num_requests=2, output_mean=8.0, output_cap=12))
    nowhere = f"127.0.0.1:{free_port()}"
    config = BenchmarkConfig("dynamic_batching", server.http_url, nowhere, None, ArrivalSpec.closed_loop(2),
                             protocol="infer")
    doc = measure(config, requests_, {})
    assert doc["protocol"] == "infer" and doc["streamed"] is False and doc["summary"]["failures"] == {}
    assert [r["num_output_tokens"] for r in doc["requests"]] == [r.max_tokens for r in requests_]
    config = BenchmarkConfig("continuous_batching", server.http_url, server.grpc_url, None,
                             ArrivalSpec.closed_loop(2), protocol="infer")
    with pytest.raises(UnmeasurableModel, match="continuous_batching is decoupled.*'http', 'grpc'"):
        measure(config, requests_, {})


def test_http_runs_need_no_grpc_port(server):
    """Over HTTP nothing goes to the gRPC address, the streaming probe included."""
    requests = build_requests(WorkloadSpec(num_requests=2, output_mean=8.0, output_cap=12))
    nowhere = f"127.0.0.1:{free_port()}"
    for model, streamed in (("continuous_batching", True), ("dynamic_batching", False)):
        config = BenchmarkConfig(model, server.http_url, nowhere, None, ArrivalSpec.closed_loop(2))
        doc = measure(config, requests, {})
        assert doc["streamed"] is streamed and doc["summary"]["failures"] == {}, model
        assert [r["num_output_tokens"] for r in doc["requests"]] == [r.max_tokens for r in requests]


def test_json_markdown_and_plots_are_written(documents):
    out, docs, _ = documents
    for model in STRATEGIES:
        assert json.loads((out / f"{model}.json").read_text())["model"] == model
        assert "| model |" in (out / f"{model}.md").read_text()
        assert "| out tok/s saturated |" in (out / f"{model}.md").read_text()
    plots.throughput_latency({m: [d] for m, d in docs.items()}, out / "tl.png")
    plots.ttft_cdf(docs, out / "ttft.png")
    plots.timeline(docs["continuous_batching"], out / "timeline.png")
    for name in ("tl.png", "ttft.png", "timeline.png"):
        assert (out / name).stat().st_size > 1000


def test_cli_streams_and_reports_counts(server, capsys):
    code = cli_main(["--http", server.http_url, "--grpc", server.grpc_url, "generate", "continuous_batching",
                     "Once upon a time", "--max-tokens", "6", "--ignore-eos"])
    out = capsys.readouterr().out
    assert code == 0 and "output_tokens=6" in out and "ttft=" in out
    code = cli_main(["--http", server.http_url, "--grpc", server.grpc_url, "generate", "continuous_batching",
                     "Once upon a time", "--max-tokens", "6", "--ignore-eos", "--protocol", "http"])
    out_http = capsys.readouterr().out
    assert code == 0 and "output_tokens=6" in out_http
    chunks = [int(re.search(r"chunks=(\d+)", text).group(1)) for text in (out, out_http)]
    assert chunks[0] == chunks[1] > 1  # server-sent events: a response per token, as over gRPC
    assert out_http.split("\n--\n")[0] == out.split("\n--\n")[0]  # the same greedy text
    code = cli_main(["--http", server.http_url, "--grpc", server.grpc_url, "info", "dynamic_batching"])
    assert code == 0 and '"max_batch_size": 8' in capsys.readouterr().out


def test_cli_asks_over_http_infer_where_the_model_is_not_decoupled(server, capsys):
    ask = ["--http", server.http_url, "--grpc", f"127.0.0.1:{free_port()}", "generate"]
    code = cli_main([*ask, "dynamic_batching", "Once upon a time", "--max-tokens", "5", "--ignore-eos",
                     "--protocol", "infer"])
    out = capsys.readouterr().out
    assert code == 0 and "output_tokens=5" in out and "finish_reason=length" in out, out
    code = cli_main([*ask, "continuous_batching", "hi", "--protocol", "infer"])
    captured = capsys.readouterr()
    assert code == 1 and captured.out == "", captured
    assert captured.err.startswith("error: [client] continuous_batching is decoupled"), captured.err
    assert "http or grpc" in captured.err and len(captured.err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [["generate", "continuous_batching", "hi", "--protocol", "grpc"],
                                     ["generate", "dynamic_batching", "hi", "--protocol", "http"],
                                     ["info", "static_batching"]])
def test_cli_without_a_server_says_so_in_one_line(capsys, command):
    url = f"127.0.0.1:{free_port()}"  # nothing listens there
    code = cli_main(["--http", url, "--grpc", url, *command])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: cannot reach the server") and "refused" in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("model", ["continuous_batching", "dynamic_batching"])
def test_cli_and_benchmark_say_so_when_only_grpc_is_unreachable(server, capsys, tmp_path, model):
    """The HTTP address answers and nothing listens on the gRPC one: one line, status 2, as when no
    server answers at all, not tritonclient's "stream is no longer in valid state" as a traceback from
    a stream, nor a benchmark that runs and fails every request."""
    nowhere = f"127.0.0.1:{free_port()}"
    code = cli_main(["--http", server.http_url, "--grpc", nowhere, "generate", model, "hi", "--protocol", "grpc"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: cannot reach the server") and "refused" in err, err
    assert len(err.strip().splitlines()) == 1
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "run", model, "--concurrency", "2",
                           "--num-requests", "2",
                           "--http", server.http_url, "--grpc", nowhere, "--metrics", server.metrics_url,
                           "--protocol", "grpc", "--out", str(tmp_path)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: cannot reach the server"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("model", ["continuous_batching", "dynamic_batching"])
def test_cli_asks_over_grpc_with_nothing_on_the_http_address(server, capsys, model):
    """A gRPC request reads the model's config over gRPC, so the gRPC port alone is enough (and the
    client holds no HTTP connection open, which would keep a SIGTERM waiting). A config read over HTTP
    would make this fail with "cannot reach the server"."""
    nowhere = f"127.0.0.1:{free_port()}"
    code = cli_main(["--http", nowhere, "--grpc", server.grpc_url, "generate", model, "Hello", "--max-tokens", "5",
                     "--ignore-eos", "--protocol", "grpc"])
    captured = capsys.readouterr()
    assert code == 0 and "output_tokens=5" in captured.out and "finish_reason=length" in captured.out, captured


def test_cli_prints_a_refused_streams_message_and_a_timeout_in_one_line(server, capsys):
    ask = ["--http", server.http_url, "--grpc", server.grpc_url]
    code = cli_main([*ask, "generate", "continuous_batching", "Hello", "--max-tokens", "5000", "--protocol", "http"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: [400] max_tokens: ") and "data:" not in err, err
    assert len(err.strip().splitlines()) == 1
    code = cli_main([*ask, "--timeout", "0.2", "generate", "continuous_batching", "Hello", "--max-tokens", "900",
                     "--ignore-eos", "--protocol", "grpc"])
    err = capsys.readouterr().err
    assert code == 1 and err.strip() == "error: no answer within --timeout 0.2 s", err


@pytest.mark.parametrize("extra, said", [
    (["--rate", "0"], "rate must be > 0"),
    (["--concurrency", "0"], "concurrency must be >= 1"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--concurrency", "4"], "never fills one"),
    (["--num-requests", "12"], "the last 4 of 12 requests would wait for ever"),
])
def test_benchmark_refuses_a_run_that_cannot_work_in_one_line(server, tmp_path, extra, said):
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "run", "static_batching", "--http", server.http_url,
                           "--grpc", server.grpc_url, "--metrics", server.metrics_url, "--out", str(tmp_path),
                           *extra], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())


def test_benchmark_warns_when_the_metrics_address_gives_nothing(server, tmp_path):
    nowhere = f"http://127.0.0.1:{free_port()}/metrics"
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "run", "dynamic_batching", "--concurrency", "2",
                           "--num-requests", "2", "--http", server.http_url, "--grpc", server.grpc_url,
                           "--metrics", nowhere, "--out", str(tmp_path)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"warning: no metrics at {nowhere}" in proc.stderr and "no saturated throughput" in proc.stderr


def test_benchmark_without_a_server_says_so_in_one_line(tmp_path):
    url = f"127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "run", "dynamic_batching", "--concurrency", "2",
                           "--num-requests", "2", "--http", url, "--grpc", url, "--metrics", f"http://{url}/metrics",
                           "--out", str(tmp_path)], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: cannot reach the server"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _process_tree(root: int) -> dict[int, str]:
    """pid -> command line of every live descendant of `root`."""
    tree = {}
    for pid in process_tree(root):
        try:
            tree[pid] = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
    return tree


def test_sigterm_to_a_benchmark_that_started_its_server_leaves_no_process(tmp_path):
    """The server dies with the script (PDEATHSIG) but its stubs would not: SIGTERM must run stop()."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchlm.bench", "run", "continuous_batching", "--start-server", "--concurrency", "2",
         "--num-requests", "64", "--out", str(tmp_path)],
        cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    tree: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            tree.update(_process_tree(proc.pid))
            if any("triton_python_backend_stub" in cmd for cmd in tree.values()):
                break
            time.sleep(0.5)
        assert any("triton_python_backend_stub" in cmd for cmd in tree.values()), "no stub started"
        time.sleep(3)  # the model is loading or serving the first requests
        tree.update(_process_tree(proc.pid))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(is_alive(pid) for pid in tree):
            time.sleep(0.2)
        assert not [cmd[:80] for pid, cmd in tree.items() if is_alive(pid)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in {**tree, **_process_tree(proc.pid)}:  # orphans too: their parent is no longer proc
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # a characterization run of a measuring tool; `make test-slow`
def test_stream_interval_sweep_writes_its_table(tmp_path):
    """`batchlm-bench stream-interval`: one server per run, a row per interval and the unstreamed reference,
    and a response per 3 tokens at interval 3 (the first text at once, and the final one)."""
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "stream-interval", "--intervals", "3",
                           "--rounds", "1",
                           "--num-requests", "8", "--concurrency", "4", "--out", str(tmp_path)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {}
    for line in (tmp_path / "stream_interval.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("3", "not streamed"):
            rows[cells[0]] = cells
    assert set(rows) == {"3", "not streamed"}
    responses = {k: float(v[5]) for k, v in rows.items()}
    runs = {p.parent.name: json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/continuous_batching-*.json")}
    assert len(runs) == 2, list(runs)
    tokens = [r["num_output_tokens"] for doc in runs.values() for r in doc["requests"]]
    mean_tokens = sum(tokens) / len(tokens)
    assert responses["not streamed"] == 1.0 and 1.0 < responses["3"] <= mean_tokens / 3 + 2, (responses, mean_tokens)
    assert all(v[6] == "0" for v in rows.values()), rows  # no failures


@pytest.mark.slow  # a characterization run of a measuring tool; `make test-slow`
def test_client_cost_measures_every_way_of_asking(tmp_path):
    """`batchlm-bench client-cost`: a row per transport, CPU per token read from the real processes; only
    the streamed ways have inter-token gaps."""
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "client-cost", "--num-requests", "3", "--rounds", "1",
                           "--out", str(tmp_path)], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {}
    for line in (tmp_path / "client_cost.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == "1":
            rows[cells[1]] = cells
    assert set(rows) == {"streamed, gRPC", "streamed, HTTP SSE", "one answer, gRPC"}, rows
    for way, cells in rows.items():
        assert float(cells[2]) > 0 and float(cells[3]) >= 0 and float(cells[4]) >= 0, cells
        assert float(cells[5]) > 0, cells  # the engine ran in the stub
        assert (cells[7] != "-") is way.startswith("streamed"), cells


@pytest.mark.slow  # NOTE: tooling beside serving; make test-slow runs it (make test stays under 10 min)
def test_queue_delay_sweep_serves_each_value_and_the_delay_forms_the_batch(tmp_path):
    """`batchlm-bench sweep` over dynamic_batching's max_queue_delay_microseconds, with the workload flags:
    four requests sent together are one batch of 4 that waited out a 1.5 s timer, and not with no timer."""
    scratch = set(Path(tempfile.gettempdir()).glob("batchlm-overrides-*"))
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "sweep", "dynamic_batching", "--vary",
                           "dynamic_batching.max_queue_delay_microseconds=0,1500000", "--out", str(tmp_path), "--",
                           "--concurrency", "4", "--num-requests", "4", "--output-min", "4", "--output-cap", "4"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    rows = {row["value"]: row for row in sweep["rows"]}
    assert list(rows) == ["0", "1500000"] and all(row["ok"] == "4/4" for row in rows.values()), rows
    assert rows["1500000"]["requests per execution"] == 4.0 and rows["1500000"]["E2E p50"] >= 1.5, rows
    assert rows["0"]["E2E p99"] < 1.5, rows  # no timer: the first request ran at once
    for value in rows:
        (doc,) = [json.loads(p.read_text()) for p in (tmp_path / value / "round-1").glob("dynamic_batching-*.json")]
        served = doc["model_config"]["dynamic_batching"].get("max_queue_delay_microseconds", 0)
        assert int(served) == int(value) and doc["overrides"] == {sweep["path"]: value}
        assert [r["num_output_tokens"] for r in doc["requests"]] == [4] * 4  # --output-min = --output-cap
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "| 1500000 | 4.000 |" in (tmp_path / "sweep.md").read_text()
    assert set(Path(tempfile.gettempdir()).glob("batchlm-overrides-*")) == scratch  # the copies are removed


@pytest.mark.slow  # NOTE: tooling beside serving; make test-slow runs it (make test stays under 10 min)
def test_two_instances_run_two_batches_at_once_and_their_metrics_add_up(tmp_path):
    """A sweep moving two fields together, --set on a list entry and on a list of scalars:
    dynamic_batching with 2 instances of 1 thread each and batches of at most (and preferably) 4 runs 8
    requests sent together as two batches of 4 at the same time, and the run's timeline sums the two
    instances' series (a KV pool of 512 blocks each, published from the load on)."""
    # NOTE: max_batch_size 4 too: with 8 allowed, Triton's batcher once formed a batch of 5 from the 8
    # requests (sent within 25 ms) and ran the other 3 after the queue delay, one instance at a time
    fixed = {"max_batch_size": "4", "dynamic_batching.preferred_batch_size": "4",
             "dynamic_batching.max_queue_delay_microseconds": "2000000"}
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "sweep", "dynamic_batching", "--out", str(tmp_path),
                           "--vary", "instance_group.0.count=2", "--vary", "parameters.num_threads=1", "--",
                           *[arg for path, value in fixed.items() for arg in ("--set", f"{path}={value}")],
                           "--concurrency", "8", "--num-requests", "8", "--output-min", "96",
                           "--output-cap", "96"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert sweep["path"] == "instance_group.0.count, parameters.num_threads" and sweep["values"] == ["2, 1"]
    assert sweep["settings"] == [{"instance_group.0.count": "2", "parameters.num_threads": "1"}]
    (doc,) = [json.loads(p.read_text()) for p in (tmp_path / "2_1" / "round-1").glob("dynamic_batching-*.json")]
    assert doc["overrides"] == {**sweep["settings"][0], **fixed} and doc["summary"]["num_ok"] == 8
    assert doc["model_config"]["instance_group"][0]["count"] == 2 and doc["model_config"]["max_batch_size"] == 4
    assert [int(b) for b in doc["model_config"]["dynamic_batching"]["preferred_batch_size"]] == [4]
    assert doc["summary"]["requests_per_execution"] == 4.0 == sweep["rows"][0]["requests per execution"]
    assert any(s["running"] == 8 for s in doc["timeline"]), doc["timeline"]  # both batches at once
    # two pools of 512 blocks, each published from its load on (so also before the first batch ran)
    assert {s["kv_total"] for s in doc["timeline"]} == {1024.0}, doc["timeline"]


@pytest.mark.parametrize("extra, said", [
    (["--set", "dynamic_batching.max_queue_delay_microseconds=1"], "--set: needs --start-server"),
    (["--start-server", "--set", "dynamic_batching.max_delay=1"], "ModelDynamicBatching has no such field"),
    (["--start-server", "--set", "max_batch_size"], "an override is PATH=VALUE"),
    (["--output-min", "9", "--output-cap", "8"], "--output-min must be <= --output-cap"),
    (["--prompt-tokens-min", "0"], "--prompt-tokens-min must be >= 1"),
])
def test_benchmark_refuses_bad_overrides_and_workloads_before_anything_starts(tmp_path, extra, said):
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "run", "dynamic_batching", "--out", str(tmp_path),
                           *extra], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())


def test_benchmark_says_in_one_line_why_triton_refused_an_override(tmp_path):
    """A value the schema allows but Triton will not load: its reason, from the server's log, in one line."""
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "run", "dynamic_batching", "--start-server",
                           "--set", "max_batch_size=-1", "--out", str(tmp_path)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: tritonserver did not load dynamic_batching: ") and \
        "'max_batch_size' must be non-negative" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("extra, said", [
    (["--vary", "max_batch_size"], "--vary: PATH=V1,V2,..."),
    (["--vary", "max_batch_size=2,two"], "--vary max_batch_size: expects an integer, got 'two'"),
    (["--vary", "max_batch_size=2,2"], "a value is given twice"),
    (["--vary", "max_batch_size=2", "--", "--out", "x"], "--out: the sweep sets it"),
    (["--vary", "max_batch_size=2", "--", "--set", "max_batch_size=4"], "the sweep varies that field"),
    (["--vary", "max_batch_size=2", "--", "--set", "nope=1"], "--set nope: ModelConfig has no such field"),
    (["--vary", "instance_group.0.count=1,2", "--vary", "parameters.num_threads=2"],
     "--vary parameters.num_threads: 1 values, the first --vary has 2"),
    (["--vary", "max_batch_size=2,4", "--vary", "max_batch_size=4,8"], "--vary max_batch_size: given twice"),
    (["--vary", "instance_group.0.count=1,2", "--vary", "parameters.num_threads=2,1", "--", "--set",
      "parameters.num_threads=1"], "--set parameters.num_threads: the sweep varies that field"),
    (["--vary", "instance_group.1.count=2"], "--vary instance_group.1: instance_group has entries 0 to 0"),
])
def test_sweep_refuses_what_would_fail_before_any_run(tmp_path, extra, said):
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "sweep", "dynamic_batching",
                           "--out", str(tmp_path / "s"), *extra],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "s").exists()
