"""Fixtures the engine's unit tests share."""

import pytest

from batchlm.model.checkpoint import load_model, write_default_checkpoint
from batchlm.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """The random-weight default model and its tokenizer, written once per module."""
    model_dir = write_default_checkpoint(tmp_path_factory.mktemp("model"), seed=0)
    return load_model(model_dir), Tokenizer.from_dir(model_dir)
