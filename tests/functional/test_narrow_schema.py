"""The client on a model with a narrower schema than this repository's (no sampling fields, no
counters), as a TensorRT-LLM ensemble has: it sends what the model declares, reads what it answers, and
refuses a field the model does not declare instead of letting HTTP turn it into a parameter."""

import shutil
import time
from pathlib import Path

import pytest

from batchlm.bench.served.arrivals import ArrivalSpec
from batchlm.bench.served.benchmark import Benchmark, BenchmarkConfig, UnmeasurableModel
from batchlm.bench.workload import WorkloadRequest
from batchlm.launcher.ports import free_port
from batchlm.launcher.triton_server import TritonServer
from batchlm_client.cli import main as cli_main
from batchlm_client.triton_llm import LLMClient, RequestFailed

MODEL = "text_only"


@pytest.fixture(scope="module")
def narrow_server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("narrow_repository")
    shutil.copytree(Path(__file__).parent / "narrow_schema_model", repository / MODEL,
                    ignore=shutil.ignore_patterns("__pycache__"))
    srv = TritonServer(model_repository=repository, http_port=free_port(), grpc_port=free_port(),
                       metrics_port=free_port(), log_path=repository.parent / "narrow_server.log")
    srv.start(timeout=120)
    yield srv
    tree = srv.descendants()
    srv.stop()
    time.sleep(0.5)
    assert not [pid for pid in tree if Path(f"/proc/{pid}").exists()], "processes left behind"


def _cli(server, *args):
    return cli_main(["--http", server.http_url, "--grpc", server.grpc_url, "generate", MODEL, "hi",
                     "--max-tokens", "3", *args])


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("stream", [True, False])
def test_cli_reads_text_without_counters(narrow_server, capsys, protocol, stream):
    code = _cli(narrow_server, "--protocol", protocol, *([] if stream else ["--no-stream"]))
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith(" w0 w1 w2\n--\n"), out
    assert "finish_reason=- input_tokens=- output_tokens=-" in out
    assert f"chunks={3 if stream else 1}" in out


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_field_the_model_does_not_declare_is_refused_naming_it(narrow_server, capsys, protocol):
    code = _cli(narrow_server, "--protocol", protocol, "--temperature", "0.5")
    err = capsys.readouterr().err
    assert code == 1
    assert "text_only has no input 'temperature'; its inputs: max_tokens, stream, text_input" in err, err
    llm = LLMClient(narrow_server.http_url, narrow_server.grpc_url)
    try:
        with pytest.raises(RequestFailed, match="no input 'ignore_eos'"):
            llm.generate(MODEL, "hi", 3, ignore_eos=True)  # HTTP alone would take it as a parameter
        assert llm.generate(MODEL, "hi", 2).text == " w0 w1"  # and the server still answers
    finally:
        llm.close()


def test_benchmark_says_what_it_cannot_measure(narrow_server):
    config = BenchmarkConfig(MODEL, narrow_server.http_url, narrow_server.grpc_url, None, ArrivalSpec.closed_loop(1))
    with pytest.raises(UnmeasurableModel, match="no num_output_tokens output"):
        Benchmark(config).run([WorkloadRequest(0, "hi", 1, 3)])
