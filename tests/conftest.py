"""Every server and model the tests start serves the tiny random checkpoint (models/tiny-random) unless a
test asks for the default model itself (tests/functional/test_real_model.py): its text is gibberish, but
every contract but the text's meaning holds on it, at a fraction of the real model's cost."""

import os

from batchlm.paths import MODEL_ENV, TINY_MODEL_DIR

os.environ[MODEL_ENV] = str(TINY_MODEL_DIR)
