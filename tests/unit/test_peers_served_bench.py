"""`batchlm-bench peers-served`: the parts that need no server (arguments, the workload, the three APIs'
requests and streams read from canned events, closed-loop streams with a fake server, the figures,
agreement, peak RSS, the tables and the message of a missing peer)."""

import os
import threading
import time

import pytest

from batchlm.bench.peers_served import server as server_module
from batchlm.bench.peers_served.cli import parse_args
from batchlm.bench.peers_served.closed_loop import run_closed_loop
from batchlm.bench.peers_served.http_api import HttpApi, StreamFailed, sse_events
from batchlm.bench.peers_served.reference import agreement
from batchlm.bench.peers_served.report import ServedRow, format_ratios, format_table, ratio
from batchlm.bench.peers_served.rss import PeakRss
from batchlm.bench.peers_served.server import SERVERS, missing
from batchlm.bench.peers_served.stats import StreamRecord, percentile, run_stats
from batchlm.bench.peers_served.workload import ServedRequest, ServedWorkloadSpec, build_workload, sequence
from batchlm.paths import DEFAULT_MODEL


def test_defaults_are_the_issue_workload_and_every_default_server_in_order():
    args = parse_args([])
    assert (args.concurrency, args.num_requests, args.max_tokens) == ([1, 8, 32], [8, 32, 64], 128)
    assert (args.prompt_tokens_min, args.prompt_tokens_max, args.threads) == (34, 42, 2)
    assert (args.agreement_prompts, args.agreement_tokens, args.llama_args) == (8, 32, "--no-repack")
    assert args.servers == [s for s in SERVERS if s not in ("triton-bf16", "engine-bf16")]
    assert str(args.out) == "results/peers_served"
    assert parse_args(["--concurrency", "1,2", "--num-requests", "3"]).num_requests == [3, 3]


@pytest.mark.parametrize("argv, named", [
    (["--servers", "triton,vllm"], "unknown servers ['vllm']"),
    (["--concurrency", "1,8", "--num-requests", "1,2,3"], "one per --concurrency"),
    (["--concurrency", "0"], "integers >= 1"),
    (["--max-tokens", "16"], "--agreement-tokens must be <= --max-tokens"),
])
def test_bad_arguments_are_refused_naming_what_is_wrong(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2 and named in capsys.readouterr().err


def test_the_workload_is_short_chat_questions_the_same_prefix_at_every_concurrency():
    spec = ServedWorkloadSpec()
    requests = build_workload(spec, 64, DEFAULT_MODEL)
    assert all(34 <= len(r.prompt_ids) <= 42 and r.max_tokens == 128 for r in requests)
    assert all(r.text.startswith("<|im_start|>system") and r.text.endswith("assistant\n") for r in requests)
    assert [r.index for r in requests] == list(range(64))
    assert len({r.prompt_ids for r in requests[:8]}) == 8  # the agreement prompts are distinct
    assert build_workload(spec, 8, DEFAULT_MODEL) == requests[:8]
    assert build_workload(ServedWorkloadSpec(seed=1), 8, DEFAULT_MODEL) != requests[:8]


def test_the_sequence_comes_round_again_when_it_outnumbers_the_prompts():
    prompts = [(f"p{i}", [i]) for i in range(3)]
    requests = sequence(prompts, 7, ServedWorkloadSpec(max_tokens=5))
    assert sorted(r.text for r in requests[:3]) == ["p0", "p1", "p2"] == sorted(r.text for r in requests[3:6])
    with pytest.raises(ValueError, match="prompt_tokens_max"):
        ServedWorkloadSpec(prompt_tokens_min=50, prompt_tokens_max=40)


def test_each_api_is_asked_greedy_exact_length_token_id_requests():
    request = ServedRequest(0, (1, 2, 3), "text", 16)
    triton = HttpApi("triton", "http://h:1", "continuous_batching").body(request)
    openai = HttpApi("openai", "http://h:2", "continuous_batching").body(request)
    llama = HttpApi("llama.cpp", "http://h:3").body(request)
    assert triton == {"input_ids": [1, 2, 3], "max_tokens": 16, "temperature": 0.0, "ignore_eos": True, "stream": True}
    assert (openai["prompt"], openai["max_tokens"], openai["ignore_eos"], openai["stream_options"]) == (
        [1, 2, 3], 16, True, {"include_usage": True})
    assert (llama["prompt"], llama["n_predict"], llama["top_k"], llama["return_tokens"]) == ([1, 2, 3], 16, 1, True)
    assert HttpApi("triton", "http://h:1", "m").url() == "http://h:1/v2/models/m/generate_stream"
    with pytest.raises(ValueError, match="HttpApi.kind"):
        HttpApi("vllm", "http://h")


class FakeResponse:
    def __init__(self, lines: list[bytes], status: int = 200):
        self.lines, self.status_code, self.text = lines, status, "refused"

    def iter_lines(self):
        yield from self.lines

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class FakeSession:
    def __init__(self, response: FakeResponse):
        self.response, self.sent = response, []

    def post(self, url, json, headers, stream, timeout):
        self.sent.append((url, headers))
        return self.response


@pytest.mark.parametrize("kind, lines, ids, text", [
    ("triton", [b'data: {"text_output": "a", "output_ids": [5], "finish_reason": ""}',
                b'data: {"text_output": "b", "output_ids": [6], "finish_reason": "length"}'], (5, 6), "ab"),
    ("openai", [b'data: {"choices": [{"text": "a"}]}', b'data: {"choices": [{"text": "b"}]}',
                b'data: {"choices": [], "usage": {"completion_tokens": 2}}', b"data: [DONE]"], (), "ab"),
    ("llama.cpp", [b'data: {"content": "a", "tokens": [5], "stop": false}',
                   b'data: {"content": "b", "tokens": [6], "stop": true, "timings": {"predicted_n": 2}}'],
     (5, 6), "ab"),
])
def test_a_stream_is_read_to_its_end_with_its_ids_or_text_and_count(kind, lines, ids, text):
    session = FakeSession(FakeResponse(lines))
    record = HttpApi(kind, "http://h:1", "m").send(session, ServedRequest(3, (1,), "t", 2), time.perf_counter())
    assert (record.index, record.output_tokens, record.token_ids, record.text) == (3, 2, ids, text)
    assert 0 <= record.sent_s <= record.first_token_s <= record.done_s
    assert session.sent[0][1] == ({"Connection": "close"} if kind == "llama.cpp" else None)


def test_a_cut_stream_an_error_event_and_an_http_error_fail_the_request():
    api, request = HttpApi("openai", "http://h:1", "m"), ServedRequest(0, (1,), "t", 2)
    for response in (FakeResponse([b'data: {"choices": [{"text": "a"}]}']), FakeResponse([], status=400),
                     FakeResponse([b'data: {"error": {"message": "no"}}'])):
        with pytest.raises(StreamFailed):
            api.send(FakeSession(response), request, time.perf_counter())
    assert list(sse_events(FakeResponse([b": comment", b'data: {"a": 1}', b"data: [DONE]", b'data: {"b": 2}']))) == [
        {"a": 1}, None]


def test_closed_loop_keeps_at_most_its_streams_in_flight_and_records_in_workload_order():
    lock, state = threading.Lock(), {"now": 0, "max": 0}
    requests = [ServedRequest(i, (i,), "", 4) for i in range(10)]

    def make_sender():
        def send(request, t0):
            with lock:
                state["now"] += 1
                state["max"] = max(state["max"], state["now"])
            time.sleep(0.01)
            with lock:
                state["now"] -= 1
            return StreamRecord(request.index, 0.0, 0.001, 0.002, 4)
        return send

    records = run_closed_loop(requests, 3, make_sender)
    assert [r.index for r in records] == list(range(10)) and state["max"] == 3

    def failing():
        def send(request, t0):
            raise StreamFailed(f"request {request.index}")
        return send

    with pytest.raises(StreamFailed, match="request"):
        run_closed_loop(requests, 2, failing)


def test_figures_are_throughput_and_percentiles_of_ttft_and_tpot():
    assert percentile([], 50) is None and percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([float(i) for i in range(101)], 99) == pytest.approx(99.0)
    records = [StreamRecord(0, 0.0, 0.5, 2.5, 5), StreamRecord(1, 0.5, 1.5, 4.0, 6), StreamRecord(2, 1.0, 1.2, 1.2, 1)]
    assert records[0].tpot_s == 0.5 and records[1].tpot_s == 0.5 and records[2].tpot_s is None
    stats = run_stats(records)
    assert (stats.requests, stats.output_tokens, stats.wall_s) == (3, 12, 4.0)
    assert stats.output_tok_per_s == 3.0 and stats.ttft_p50_s == pytest.approx(0.5)
    assert stats.tpot_p50_s == 0.5 and stats.as_dict()["output_tok_per_s"] == 3.0


def test_agreement_compares_ids_where_the_api_returns_them_else_text():
    reference = [[5, 6], [7, 8], [9, 9]]
    records = [StreamRecord(0, 0, 0, 0, 3, (5, 6, 1)), StreamRecord(1, 0, 0, 0, 3, (7, 1, 8)),
               StreamRecord(2, 0, 0, 0, 3, text="99 and more"), StreamRecord(3, 0, 0, 0, 3, (1,))]
    assert agreement(records, reference, lambda ids: "".join(map(str, ids))) == (2, 3)
    assert agreement(records[:2], reference, str) == (1, 2)


def test_peak_rss_sees_memory_allocated_inside_the_block():
    with PeakRss([os.getpid()], interval_s=0.01) as rss:
        block = bytearray(64 << 20)
        time.sleep(0.05)
    assert rss.peak_mib > 64 and block


def _row(server, streams, tok_per_s, agree=(8, 8)):
    stats = run_stats([StreamRecord(0, 0.0, 0.1, 1.0, int(tok_per_s))])
    return ServedRow(server, streams, stats=stats, peak_rss_mib=300.0, agreement=agree)


def test_the_tables_show_every_row_and_the_subjects_ratio_over_each_peer():
    rows = [_row("triton", 1, 30), _row("triton", 8, 160), _row("llama-q4_1", 1, 60), _row("llama-q4_1", 8, 80),
            ServedRow("openvino-gguf", 1, status="skipped: openvino_genai is not installed")]
    table = format_table(rows)
    assert "| llama-server, shipped Q4_1 file | 8 | 80.0 | 100 | 100 |" in table
    assert "| 300 | 8/8 |" in table and "skipped: openvino_genai is not installed" in table
    assert ratio(rows, "llama-q4_1", 1) == 0.5 and ratio(rows, "openvino-gguf", 1) is None
    ratios = format_ratios(rows)
    assert "| 1 streams | 8 streams |" in ratios and "| llama-server, shipped Q4_1 file | 0.50x | 2.00x |" in ratios
    assert "| n/a | n/a |" in ratios and "continuous_batching, Triton generate_stream |" not in ratios.splitlines()[2]


def test_the_int8_run_gets_its_own_ratios_over_each_server():
    rows = [_row("triton", 8, 160), _row("triton-int8", 8, 320, agree=(6, 8)), _row("llama-q4_1", 8, 80)]
    assert ratio(rows, "llama-q4_1", 8, "triton-int8") == 4.0
    first, fast = format_ratios(rows).split("\n\n")
    assert "| continuous_batching, int8 activations, Triton generate_stream | 0.50x |" in first
    assert fast.startswith("| continuous_batching, int8 activations, Triton generate_stream over | 8 streams |")
    assert "| llama-server, shipped Q4_1 file | 4.00x |" in fast
    assert "| continuous_batching, Triton generate_stream | 2.00x |" in fast
    assert "\n\n" not in format_ratios(rows[:1] + rows[2:])  # no int8 run, no second table
    assert "6/8" in format_table(rows)
    with_bf16 = format_ratios(rows + [_row("triton-bf16", 8, 240)]).split("\n\n")
    assert len(with_bf16) == 3 and with_bf16[2].startswith(
        "| continuous_batching, bfloat16 activations, Triton generate_stream over | 8 streams |")
    assert "| llama-server, shipped Q4_1 file | 3.00x |" in with_bf16[2]


def test_a_missing_peer_is_skipped_naming_what_provides_it(monkeypatch):
    monkeypatch.setattr(server_module, "binary", lambda name: None)
    assert "scripts/build_llama_server.sh" in missing(SERVERS["llama-q8_0"])
    assert missing(SERVERS["triton"]) is None
    monkeypatch.setattr(server_module.importlib.util, "find_spec", lambda name: None)
    assert ".[peers-served]" in missing(SERVERS["openvino-ir"])
