"""`batchlm-bench peers`: its pure parts (arguments, request-level groups, truncation, agreement, the table,
the skip message of a missing peer) and one small run through the project's engine and CTranslate2."""

import json
import subprocess
import sys

import pytest

from batchlm.bench.peers.checkpoint import checkpoint_digest
from batchlm.bench.peers.cli import parse_args
from batchlm.bench.peers.groups import request_groups, truncate
from batchlm.bench.peers.peer import EXTRA_HINT, PEERS, Peer, missing_modules, skip_message
from batchlm.bench.peers.report import agreement, format_table, summarize
from batchlm.bench.peers.workload import PeerRequest, load_workload
from batchlm.paths import TINY_MODEL_DIR, PROJECT_ROOT


def test_defaults_are_the_issue_workload_and_every_engine_in_order():
    args = parse_args([])
    assert (args.num_requests, args.prompt_tokens_min, args.prompt_tokens_max) == (64, 32, 256)
    assert (args.output_mean, args.output_cap, args.max_num_seqs, args.threads) == (128.0, 512, 8, 2)
    assert args.engines == ["batchlm", "hf-cb", "hf-static", "ct2", "llama.cpp"] == list(PEERS)
    assert str(args.out) == "results/peers" and args.workload is None
    assert parse_args(["--engines", "ct2, batchlm", "--num-requests", "4"]).engines == ["ct2", "batchlm"]


@pytest.mark.parametrize("argv, named", [(["--engines", "batchlm,vllm"], "unknown engines ['vllm']"),
                                         (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1")])
def test_bad_arguments_are_refused_naming_what_is_wrong(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2 and named in capsys.readouterr().err


def test_request_level_groups_keep_arrival_order_and_the_last_may_be_short():
    assert request_groups(20, 8) == [list(range(8)), list(range(8, 16)), [16, 17, 18, 19]]
    assert request_groups(8, 8) == [list(range(8))]
    assert request_groups(3, 8) == [[0, 1, 2]]
    with pytest.raises(ValueError):
        request_groups(3, 0)


def test_truncation_cuts_each_row_to_its_own_length_and_refuses_a_short_row():
    rows = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert truncate(rows, [4, 1, 2]) == [[1, 2, 3, 4], [5], [9, 10]]
    with pytest.raises(ValueError, match="fewer tokens"):
        truncate([[1, 2]], [3])
    with pytest.raises(ValueError, match="rows"):
        truncate(rows, [1])


def test_agreement_counts_equal_requests_and_the_tokens_before_each_first_difference():
    reference = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10]]
    assert agreement(reference, reference) == (1.0, 1.0)
    requests_equal, tokens_equal = agreement([[1, 2, 0, 4], [5, 6], [0, 8, 9, 10]], reference)
    assert requests_equal == pytest.approx(1 / 3)
    assert tokens_equal == pytest.approx((2 + 2 + 0) / 10)  # tokens after a difference do not count


def test_a_missing_package_is_skipped_naming_the_extra_and_the_table_still_prints():
    absent = Peer("absent", "request-level", ("batchlm_no_such_module",), ("no-such-dist",))
    missing = missing_modules(absent)
    assert missing == ["batchlm_no_such_module"]
    message = skip_message(absent, missing)
    assert "batchlm_no_such_module" in message and EXTRA_HINT in message and "[peers]" in message
    requests = [PeerRequest(0, [1, 5], 2), PeerRequest(1, [1, 6, 7], 3)]
    ok = {"engine": "batchlm", "tokens": [[3, 4], [5, 6, 7]], "ttft_s": [0.1, 0.3], "e2e_s": [0.5, 1.5],
          "wall_s": 1.0}
    slower = {"engine": "ct2", "tokens": [[3, 4], [5, 9, 9]], "ttft_s": [0.2, 0.2], "e2e_s": [2.0, 2.0],
              "wall_s": 4.0, "versions": {"ctranslate2": "9.9"}}
    skipped = {"engine": "llama.cpp", "skipped": message}
    rows = [summarize(r, requests, [[3, 4], [5, 6, 7]]) for r in (ok, slower, skipped)]
    assert rows[0]["output_tok_per_s"] == 5.0 and rows[0]["p50_e2e_s"] == 1.0 and rows[0]["p50_ttft_s"] == 0.2
    assert rows[1]["requests_equal"] == 0.5 and rows[1]["tokens_equal"] == pytest.approx(3 / 5)
    assert rows[2]["status"] == message
    table = format_table(rows).splitlines()
    assert table[0].startswith("| engine | batching | output tok/s | batchlm / this |")
    assert "| batchlm | continuous, 8 in flight | 5.0 | 1.00x | 1.00 | 0.20 | 100.0% | 100.0% |" in table
    assert "| ct2 (ctranslate2 9.9) | request-level: `generate_batch`, groups of 8 | 1.2 | 4.00x | 2.00 | 0.20 " \
           "| 50.0% | 60.0% |" in table
    assert any(line.startswith("| llama.cpp |") and EXTRA_HINT in line for line in table)


def test_a_short_output_is_reported_and_no_subject_row_prints_no_ratio():
    requests = [PeerRequest(0, [1], 3)]
    row = summarize({"engine": "ct2", "tokens": [[1, 2]], "ttft_s": [0.1], "e2e_s": [0.2], "wall_s": 0.5},
                    requests, None)
    assert row["wrong_lengths"] == [0] and "requests_equal" not in row
    assert "| 4.0 | n/a | 0.20 | 0.10 | n/a | n/a |" in format_table([row])


def test_a_workload_file_is_read_and_checked(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps([{"prompt_ids": [1, 2, 3], "max_tokens": 4}, {"prompt_ids": [1], "max_tokens": 1}]))
    assert load_workload(path) == [PeerRequest(0, [1, 2, 3], 4), PeerRequest(1, [1], 1)]
    path.write_text(json.dumps([{"prompt_ids": [], "max_tokens": 4}]))
    with pytest.raises(ValueError, match="request 0: prompt_ids"):
        load_workload(path)


def test_the_checkpoint_digest_is_stable_and_short():
    assert checkpoint_digest(TINY_MODEL_DIR) == checkpoint_digest(TINY_MODEL_DIR)
    assert len(checkpoint_digest(TINY_MODEL_DIR)) == 16


def test_a_small_run_of_the_engine_and_ctranslate2_agrees_token_for_token(tmp_path):
    pytest.importorskip("ctranslate2", reason=f"the `peers` extra is not installed ({EXTRA_HINT})")
    pytest.importorskip("transformers", reason="CTranslate2's converter reads the checkpoint with transformers")
    proc = subprocess.run([sys.executable, "-m", "batchlm.bench", "peers", "--engines", "batchlm,ct2",
                           "--num-requests", "4", "--prompt-tokens-max", "48", "--output-mean", "6",
                           "--output-cap", "12", "--out", str(tmp_path)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "peers.json").read_text())
    outputs = result["outputs"]
    assert len(outputs["batchlm"]) == 4 and outputs["batchlm"] == outputs["ct2"]
    rows = {row["engine"]: row for row in result["rows"]}
    assert all(rows[e]["status"] == "ok" and rows[e]["output_tok_per_s"] > 0 and not rows[e]["wrong_lengths"]
               for e in ("batchlm", "ct2"))
    assert "| batchlm | continuous, 8 in flight |" in proc.stdout and "| 1.00x |" in proc.stdout
    assert (tmp_path / "peers.md").read_text().startswith("| engine |")
