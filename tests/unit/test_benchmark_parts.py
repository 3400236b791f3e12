"""Benchmark building blocks without a server: arrivals, per-request stats, metrics parsing, variants."""

import contextlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from batchlm.bench.workload import WorkloadSpec, build_requests
from batchlm.bench.served.arrivals import ArrivalSpec
from batchlm.bench.served.comparison import saturated_tok, targets_table, write_variant
from batchlm.bench.served.metrics_timeline import (MetricsTimeline, parse_metrics, requests_per_execution,
                                                  saturated_window)
from batchlm.bench.served.request_record import SLO, RequestRecord, summarize
from batchlm.bench.served.sweep import sweep_markdown, sweep_rows
from batchlm_client.triton_llm import LLMClient, RequestFailed


def test_open_loop_times_are_seeded_with_the_asked_mean_rate():
    spec = ArrivalSpec.open_loop(4.0, seed=3)
    times = spec.send_times(2000)
    assert times == ArrivalSpec.open_loop(4.0, seed=3).send_times(2000) and times[0] == 0.0
    assert times[-1] / len(times) == pytest.approx(0.25, rel=0.1)
    bursty = ArrivalSpec.open_loop(4.0, burstiness=0.25, seed=3).send_times(2000)
    gaps = [b - a for a, b in zip(bursty, bursty[1:])]
    assert max(gaps) > max(b - a for a, b in zip(times, times[1:]))
    assert spec.label == "open-loop poisson 4.00 req/s"
    assert ArrivalSpec.closed_loop(32).label == "closed-loop c=32"


def test_arrival_spec_validates():
    with pytest.raises(ValueError, match="rate"):
        ArrivalSpec(mode="open", rate=0)
    with pytest.raises(ValueError, match="mode"):
        ArrivalSpec(mode="sometimes")


def test_benchmark_config_names_a_bad_protocol():
    from batchlm.bench.served.benchmark import BenchmarkConfig

    assert BenchmarkConfig("m").protocol == "http"
    assert BenchmarkConfig("m", protocol="grpc").protocol == "grpc"
    with pytest.raises(ValueError, match="protocol"):
        BenchmarkConfig("m", protocol="websocket")
    assert BenchmarkConfig("m", protocol="infer", stream=False).protocol == "infer"
    with pytest.raises(ValueError, match="'infer' cannot stream"):
        BenchmarkConfig("m", protocol="infer", stream=True)


def test_summary_tpot_gaps_goodput_and_failures():
    ok = RequestRecord(0, 10, 5, ttft=0.5, latency=1.3, num_output_tokens=5,
                       chunk_times=[0.5, 0.7, 0.9, 1.1, 1.3])
    slow = RequestRecord(1, 10, 3, ttft=9.0, latency=10.0, num_output_tokens=3, chunk_times=[9.0, 9.5, 10.0])
    failed = RequestRecord(2, 10, 3, error="503")
    s = summarize([ok, slow, failed], duration=10.0, slo=SLO(ttft=5.0, tpot=0.25))
    assert ok.tpot == pytest.approx(0.2) and slow.tpot == pytest.approx(0.5)
    assert s["num_ok"] == 2 and s["failures"] == {"503": 1}
    assert s["output_token_throughput"] == pytest.approx(0.8) and s["goodput"] == pytest.approx(0.1)
    assert s["itl"]["count"] == 6 and s["ttft"]["p50"] == pytest.approx(4.75)
    assert RequestRecord(3, 1, 4, ttft=1, latency=1, num_output_tokens=4, chunk_times=[1]).tpot is None


def test_parse_metrics_reads_one_model():
    text = ('batchlm_forward_sequences{model="a"} 3\nbatchlm_forward_sequences{model="b"} 7\n'
            'nv_inference_pending_request_count{model="a",version="1"} 2\n# HELP x\n')
    assert parse_metrics(text, "a") == {"forward_sequences": 3.0, "triton_pending": 2.0}


def test_parse_metrics_sums_a_model_over_its_instances():
    text = ('batchlm_kv_blocks_total{instance="a_0_0",model="a"} 512\n'
            'batchlm_kv_blocks_total{instance="a_0_1",model="a"} 512\n'
            'batchlm_running_requests{instance="a_0_0",model="a"} 4\n'
            'batchlm_running_requests{instance="a_0_1",model="a"} 3\n'
            'batchlm_running_requests{instance="ab_0_0",model="ab"} 8\n')
    assert parse_metrics(text, "a") == {"kv_total": 1024.0, "running": 7.0}


class _MetricsPage(BaseHTTPRequestHandler):
    tokens = 100  # the counter the page shows; a test moves it

    def do_GET(self):  # noqa: N802 - http.server's name
        _reply(self, f'batchlm_generated_tokens_total{{model="m"}} {type(self).tokens}\n'.encode())

    def log_message(self, *args):
        pass


def _reply(handler: BaseHTTPRequestHandler, body: bytes) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@contextlib.contextmanager
def _serving(handler):
    """A metrics page served by `handler` on a free port; yields its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()


class _ConfigPage(BaseHTTPRequestHandler):
    reads: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        _ConfigPage.reads.append(self.path)
        _reply(self, b'{"name": "m", "model_transaction_policy": {"decoupled": true}}')

    def log_message(self, *args):
        pass


def test_a_models_config_is_read_once_on_the_channel_its_protocol_uses():
    # "http" and "infer" requests read it over HTTP (one read for both); "grpc" over gRPC, which is not
    # served here, so it cannot come from the HTTP read; any other protocol is refused.
    _ConfigPage.reads = []
    with _serving(_ConfigPage) as url:
        llm = LLMClient(http_url=url.removeprefix("http://").removesuffix("/metrics"), grpc_url="127.0.0.1:1")
        assert llm.is_decoupled("m", "http") and llm.is_decoupled("m", "infer")
        assert _ConfigPage.reads == ["/v2/models/m/config"]
        with pytest.raises(ValueError, match="via must be one of"):
            llm.model_config("m", "generate")
        with pytest.raises(RequestFailed, match="UNAVAILABLE"):
            llm.model_config("m", "grpc")
        assert _ConfigPage.reads == ["/v2/models/m/config"]
        # a client started from another's configs (the benchmark's, one per thread) reads none again
        assert LLMClient(http_url=llm.http_url, configs_of=llm).is_decoupled("m", "infer")
        assert _ConfigPage.reads == ["/v2/models/m/config"]


def test_timeline_counts_a_run_shorter_than_one_interval():
    # The baseline is scraped on entry and a closing sample taken on exit: no token of the run is lost.
    _MetricsPage.tokens = 100
    with _serving(_MetricsPage) as url, MetricsTimeline(url, "m", interval=30.0) as timeline:
        _MetricsPage.tokens = 142
    assert [s.generated_tokens for s in timeline.samples] == [42.0]


def test_timeline_baseline_waits_for_counters_pushed_late():
    # Work answered just before the run (the streaming probe) reaches the page a moment late: the
    # baseline waits for it instead of counting it in the run.
    class LatePage(_MetricsPage):
        scrapes = 0

        def do_GET(self):  # noqa: N802
            type(self).scrapes += 1
            if type(self).scrapes == 2:
                type(self).tokens = 101  # the probe's token lands between the first two scrapes
            super().do_GET()

    LatePage.tokens = 100
    with _serving(LatePage) as url, MetricsTimeline(url, "m", interval=30.0) as timeline:
        LatePage.tokens = 141
    assert [s.generated_tokens for s in timeline.samples] == [40.0]


def test_variant_repository_overrides_parameters(tmp_path):
    write_variant(tmp_path, "continuous_batching", {"max_num_seqs": "64"})
    config = text_format.Parse((tmp_path / "continuous_batching" / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["max_num_seqs"] == "64" and params["num_kv_blocks"] == "512"  # the rest as shipped
    assert params["model_dir"].startswith("/") and (tmp_path / "continuous_batching" / "1" / "model.py").exists()
    assert config.model_transaction_policy.decoupled


def _sample(t, waiting, tokens):
    return {"t": t, "seqs_per_forward": 8.0, "forward_passes": 10.0, "waiting": waiting, "running": 8.0,
            "kv_used": 0.0, "kv_total": 512.0, "generated_tokens": tokens}


def test_saturated_window_stops_at_the_last_sample_with_a_request_waiting():
    # 2 s saturated at 100 tok/s, then a drain at 20 tok/s with nothing waiting
    samples = [_sample(0.5 * i, 5 if i <= 4 else 0, 50 if i <= 4 else 10) for i in range(1, 11)]
    window = saturated_window(samples)
    assert window == {"output_tokens": 200, "duration_s": 2.0, "output_token_throughput": 100.0}
    assert saturated_window([_sample(0.5, 0, 50)]) is None  # never saturated
    assert saturated_window([_sample(0.5, 3, 0), _sample(1.0, 3, 0)]) is None   # no token counter
    # requests sent together, seen waiting for the engine's first step, and never again: not saturated
    assert saturated_window([_sample(0.25, 3, 1)] + [_sample(0.25 * i, 0, 100) for i in range(2, 9)]) is None


def test_saturated_figures_fall_back_to_the_whole_run_and_the_targets_table_shows_both():
    doc = {"summary": {"output_token_throughput": 80.0, "saturated": {"output_token_throughput": 100.0}}}
    assert saturated_tok(doc) == 100.0
    assert saturated_tok({"summary": {"output_token_throughput": 80.0, "saturated": None}}) == 80.0
    assert saturated_tok({"output_token_throughput": 70.0, "saturated": None}) == 70.0  # in process
    table = targets_table([{"target": "x / y", "measured": 2.4, "whole_run": 2.25, "required": ">= 2.3",
                            "holds": True},
                           {"target": "p50", "measured": 0.4, "whole_run": None, "required": "<= 0.5",
                            "holds": True}])
    assert "| x / y | 2.40 | 2.25 | >= 2.3 | yes |" in table and "| p50 | 0.40 | - | <= 0.5 | yes |" in table
    on_the_line = targets_table([{"target": "z", "measured": 2.2992, "whole_run": None, "required": ">= 2.3",
                                  "holds": False}])
    assert "| z | 2.299 | - | >= 2.3 | NO |" in on_the_line


def test_grpc_waits_are_lengthened_only_inside_a_run():
    from grpc import _common

    from batchlm.bench.served.benchmark import GRPC_WAIT_SECONDS, _quiet_grpc_waits

    before = _common.MAXIMUM_WAIT_TIMEOUT
    with _quiet_grpc_waits():
        assert _common.MAXIMUM_WAIT_TIMEOUT == max(before, GRPC_WAIT_SECONDS)
    assert _common.MAXIMUM_WAIT_TIMEOUT == before
    with pytest.raises(RuntimeError), _quiet_grpc_waits():
        raise RuntimeError("a failed run restores it too")
    assert _common.MAXIMUM_WAIT_TIMEOUT == before


def test_load_table_reads_sequences_per_forward_and_busy_samples():
    from batchlm.bench.served.comparison import STRATEGIES, idle_fraction, load_table

    def doc(samples):  # (forward passes, sequences per forward) per timeline sample
        return {"timeline": [{"forward_passes": n, "seqs_per_forward": s} for n, s in samples],
                "summary": {"e2e": {"p50": 1.5}, "ttft": {"p50": 0.25}}}

    docs = {f"{name}/point": doc([(10, 1.0), (30, 2.0), (0, 0.0), (0, 0.0)]) for name in STRATEGIES}
    docs["continuous_batching/point"] = doc([])
    assert idle_fraction(docs["static_batching/point"], 8) == 1.0 - 1.75 / 8
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in load_table(docs, "point").splitlines()[2:]}
    assert rows["static_batching"] == ["static_batching", "1.75", "50%", "1.500", "0.250"]
    assert rows["continuous_batching"][1:3] == ["-", "-"]  # no timeline: not guessed


def test_http_error_message_reads_a_json_body_and_a_refused_streams_event():
    from batchlm_client.triton_llm import http_error_message

    assert http_error_message(b'{"error": "max_tokens: too many"}') == "max_tokens: too many"
    assert http_error_message(b'data: {"error":"max_tokens: too many"}\n\n') == "max_tokens: too many"
    assert http_error_message(b"<html>bad gateway</html>") == "<html>bad gateway</html>"
    assert http_error_message(None) == ""


def test_unfillable_batches_names_what_would_wait_for_ever():
    from batchlm.bench.served.arrivals import ArrivalSpec
    from batchlm.bench.served.benchmark import unfillable_batches

    static = {"name": "static_batching", "parameters": {"batch_size": {"string_value": "8"}}}
    assert unfillable_batches(static, 64, ArrivalSpec.closed_loop(8)) is None
    assert unfillable_batches(static, 64, ArrivalSpec.open_loop(2.0)) is None
    assert "closed loop at 4 in flight never fills one" in unfillable_batches(static, 64, ArrivalSpec.closed_loop(4))
    assert "the last 3 of 11 requests" in unfillable_batches(static, 11, ArrivalSpec.open_loop(2.0))
    dynamic = {"name": "dynamic_batching", "max_batch_size": 8, "parameters": {}}
    assert unfillable_batches(dynamic, 11, ArrivalSpec.closed_loop(1)) is None


def test_requests_per_execution_is_the_batch_triton_formed():
    samples = [{"executions": 2.0, "inferences": 9.0}, {"executions": 0.0, "inferences": 0.0},
               {"executions": 1.0, "inferences": 3.0}]
    assert requests_per_execution(samples) == 4.0
    assert requests_per_execution([{"executions": 0.0, "inferences": 0.0}]) is None
    assert requests_per_execution([_sample(1.0, 0, 10)]) is None  # a timeline from before the field


def test_fixed_output_lengths_and_their_checks():
    spec = WorkloadSpec(num_requests=16, output_min=20, output_cap=20)
    assert {r.max_tokens for r in build_requests(spec)} == {20}
    assert spec.static_speedup_bound(8) == pytest.approx(1.0)  # every row finishes together
    with pytest.raises(ValueError, match="output_min must be <= output_cap"):
        WorkloadSpec(output_min=21, output_cap=20)


def _run_doc(tok_s, e2e_p50, ok, failures, executions=2.0, inferences=6.0):
    quantiles = {"mean": e2e_p50, "p50": e2e_p50, "p90": e2e_p50, "p99": e2e_p50}
    return {"summary": {"requests_per_execution": inferences / executions, "request_throughput": 1.0,
                        "output_token_throughput": tok_s, "saturated": None, "ttft": quantiles, "e2e": quantiles,
                        "num_ok": ok, "num_requests": 4, "failures": failures},
            "timeline": [{"seqs_per_forward": 3.0, "forward_passes": 10.0}]}


def test_sweep_rows_take_medians_over_rounds_and_add_up_answers_and_failures():
    runs = {"0": [_run_doc(100.0, 1.0, 4, {}), _run_doc(300.0, 3.0, 4, {}), _run_doc(200.0, 2.0, 3, {"503": 1})],
            "50000": [_run_doc(50.0, 5.0, 2, {"503": 1, "400": 1}, executions=1.0, inferences=4.0)]}
    rows = sweep_rows(runs)
    assert [r["value"] for r in rows] == ["0", "50000"]
    assert rows[0]["out tok/s"] == 200.0 and rows[0]["E2E p50"] == 2.0 and rows[0]["rounds"] == 3
    assert rows[0]["requests per execution"] == 3.0 and rows[0]["seqs per forward"] == 3.0
    assert rows[0]["ok"] == "11/12" and rows[0]["failures"] == "503: 1"
    assert rows[1]["ok"] == "2/4" and rows[1]["failures"] == "400: 1, 503: 1"
    assert rows[0]["out tok/s saturated"] is None  # an open-loop run has no saturated window
    table = sweep_markdown("dynamic_batching", "max_batch_size", rows, "closed-loop c=4", "batchlm-bench sweep",
                           {"cpu": "Some CPU", "cpu_count": 2})
    assert "Machine: Some CPU x2" in table
    assert "| 0 | 3.000 | 3.000 | 1.000 | 200.0 | - | 2.000 |" in table


def test_compare_runs_through_either_door(monkeypatch, tmp_path):
    """`compare --protocol openai` gives every run's server a frontend and points the benchmark at it; the
    other transports go to Triton straight."""
    import sys

    from batchlm.launcher.frontend_process import FrontendProcess, ServerWithFrontend
    from batchlm.bench.served import compare
    from batchlm.bench.served.arrivals import ArrivalSpec

    for protocol in ("openai", "grpc"):
        monkeypatch.setattr(sys, "argv", ["compare", "--protocol", protocol, "--num-requests", "8",
                                          "--num-open", "8", "--num-reference", "8", "--out", str(tmp_path)])
        runner = compare.Comparison(compare.parse_args())
        frontend = FrontendProcess("", port=9123) if protocol == "openai" else None
        server = ServerWithFrontend(frontend=frontend)
        config = runner._config(server, "continuous_batching", ArrivalSpec.closed_loop(8))
        assert config.protocol == protocol
        assert (config.openai_url == "http://127.0.0.1:9123/v1") is (protocol == "openai"), config.openai_url


@pytest.mark.parametrize("args, said", [
    (["--num-reference", "100"], "--num-reference: static_batching answers only full batches of 8: the last 4 of 100"),
    (["--concurrency", "4"], "--num-requests / --concurrency: static_batching answers only full batches of 8: "
                             "closed loop at 4 in flight never fills one"),
])
def test_compare_refuses_counts_static_batching_cannot_answer_before_it_measures(tmp_path, args, said):
    # Refusing the run only on reaching static batching would come after the other strategies' runs
    # (most of an hour), and --report-only would then have no comparison.json to rebuild from.
    import subprocess
    import sys

    from batchlm.paths import PROJECT_ROOT

    out = tmp_path / "compare"
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "compare", *args, "--out", str(out)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {said}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()


def test_the_report_says_what_it_could_not_measure_instead_of_crashing():
    # seed_table must not raise TypeError on a run without metrics samples or without a successful
    # request, nor targets ZeroDivisionError where every static request has failed.
    from batchlm.bench.served.comparison import STRATEGIES, seed_table, targets

    def doc(tokens, p50, timeline):
        stats = {"p50": p50, "p99": p50}
        return {"timeline": timeline, "arrival": {"label": "open-loop poisson 1.00 req/s"},
                "summary": {"output_token_throughput": tokens, "saturated": None, "request_throughput": 1.0,
                            "e2e": stats, "ttft": stats}}

    busy = [{"forward_passes": 4, "seqs_per_forward": 8.0}]
    docs = {}
    for name in STRATEGIES:
        docs[f"{name}/saturation"] = doc(100.0, 1.0, busy)
        docs[f"{name}/point"] = doc(50.0, 1.0, busy)
    docs["static_batching/saturation"] = doc(0.0, None, [])  # every request failed, no metrics
    docs["dynamic_batching/point"] = doc(0.0, None, [])
    docs["continuous_batching_same_kv/saturation"] = doc(400.0, 1.0, busy)
    rows = {line.split("|")[1].strip(): line for line in seed_table(docs, "point").splitlines()[2:]}
    assert "| - of slots empty or padding; no forward in - of samples |" in rows["static_batching"]
    assert "E2E p50 - s / p99 - s; TTFT p50 - s" in rows["dynamic_batching"]
    found = {r["target"].split(" at ")[0]: r for r in targets(docs, "point", 2.6, {"output_token_throughput": 90.0})}
    static_ratio = found["continuous / static output tok/s"]
    assert static_ratio["measured"] is None and static_ratio["holds"] is False
    assert found["continuous / dynamic p50 E2E"]["measured"] is None
    assert found["continuous / dynamic output tok/s"]["measured"] == 1.0
    assert "| - | - | >= 2.34 | NO |" in targets_table([static_ratio])  # 0.9 x the bound, 2.6


def test_the_comparison_says_whether_each_strategy_cached_prefixes():
    from types import SimpleNamespace

    from batchlm.bench.served.compare import Comparison

    def doc(**params):
        return {"model_config": {"parameters": {"model_dir": {"string_value": "models/tiny-random"},
                                                **{k: {"string_value": v} for k, v in params.items()}}}}

    docs = {"static_batching/saturation-repeat-1": doc(enable_prefix_caching="false"),
            "dynamic_batching/saturation-repeat-1": doc(),
            "continuous_batching/saturation-repeat-1": doc(enable_prefix_caching="true")}
    assert Comparison._caching(SimpleNamespace(docs=docs)) == \
        "on in continuous_batching, on in dynamic_batching, off in static_batching"
