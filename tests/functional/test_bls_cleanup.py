"""The premise of `batchlm.backend.trtllm.bls_reaper`, on this project's real tritonserver: a cancellation
check made after a decoupled BLS call has ended is answered only after the stub has let go of the
call's iterator, so Python's share, dropped after that answer, is the last one and is freed under
the GIL.

`tests/functional/bls_threads_repro.py --noise` forces the race the reaper avoids (log round trips queued ahead
of each call's cleanup, so Python lets go first). Without `--remedy`, 16 in flight, its caller's stub
died in 6 of 8 runs (after 64 and 29 of 1,600 requests, 176 of 320, 65, 66 and 320 of
480; the other two answered all 320 and all 480). With `--remedy` (one `is_cancelled()` before letting go) every
request must be answered and both stubs must be alive at the end (320 requests: 5 of those 6 deaths came
within the first 176).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from batchlm.paths import PROJECT_ROOT


# NOTE: slow: a stress run (16 clients, 320 requests through two stubs) of a python_backend defect's premise;
# the front's own behaviour is in tests/functional/test_trtllm_front.py and tests/unit/test_bls_reaper.py
@pytest.mark.slow
def test_a_round_trip_after_the_call_keeps_the_stub_alive(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tests.functional.bls_threads_repro", "--noise", "--remedy",
                           "--concurrency", "16", "--requests", "320", "--work", str(tmp_path)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "answered 320 of 320, stalled 0" in proc.stdout
    assert "stubs alive at the end: ['callee', 'caller']" in proc.stdout
