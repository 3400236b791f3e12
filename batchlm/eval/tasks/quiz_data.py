"""The quiz tasks' questions, read from the JSON-lines files beside this module, wherever lm-eval runs from
(a `dataset_path: json` task would read its `data_files` relative to the working directory)."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _split(name: str):
    import datasets  # lm-eval's own dependency, present wherever lm-eval calls this

    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_mc(**_metadata):
    """`custom_dataset` of batchlm_quiz_mc; lm-eval passes the run's metadata (model args among it), unused."""
    return _split("quiz_mc.jsonl")


def load_gen(**_metadata):
    """`custom_dataset` of batchlm_quiz_gen."""
    return _split("quiz_gen.jsonl")
