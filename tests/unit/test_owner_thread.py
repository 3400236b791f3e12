"""OwnerThread builds and loops on one thread; LLMEngine warns when stepped from another thread."""

import threading
import warnings

import pytest

from batchlm.engine.owner_thread import OwnerThread


def test_build_and_loop_run_on_the_same_thread_and_the_value_is_returned():
    seen = {}
    done = threading.Event()

    def build():
        seen["build"] = threading.get_ident()
        return "model"

    def loop(value):
        seen["loop"] = threading.get_ident()
        seen["value"] = value
        done.set()

    owner = OwnerThread("test-owner", build, loop)
    assert owner.value == "model"
    assert done.wait(5) and owner.join(5)
    assert seen["build"] == seen["loop"] != threading.get_ident()
    assert seen["value"] == "model" and not owner.is_current()


def test_a_build_error_is_raised_to_the_caller_and_the_loop_never_runs():
    ran = []

    def build():
        raise ValueError("no checkpoint")

    with pytest.raises(ValueError, match="no checkpoint"):
        OwnerThread("test-owner", build, ran.append)
    assert ran == []


def test_engine_warns_once_when_stepped_from_another_thread(tmp_path):
    from batchlm.engine.engine import LLMEngine
    from batchlm.engine.engine_config import EngineConfig
    from batchlm.engine.sampling import SamplingParams
    from batchlm.model.checkpoint import write_default_checkpoint

    engine = LLMEngine(write_default_checkpoint(tmp_path, seed=0),
                       EngineConfig(num_kv_blocks=16, max_model_len=128, num_threads=1))
    with warnings.catch_warnings(record=True) as same_thread:
        warnings.simplefilter("always")
        engine.generate(["Hello"], SamplingParams(max_tokens=2, ignore_eos=True))
    assert not [w for w in same_thread if issubclass(w.category, RuntimeWarning)]
    caught = []

    def other():
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            engine.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True))
        caught.extend(w for w in record if issubclass(w.category, RuntimeWarning))

    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert len(caught) == 1 and "OpenMP" in str(caught[0].message)
