"""lm-evaluation-harness against the served model: the project's own quiz (tasks/, lm-eval task YAML and
JSON-lines data), the runs of both sides (run.py, `batchlm-bench eval`) and their item-by-item comparison
(compare.py).

No text of the quiz holds a digit: transformers builds the default GGUF file's tokenizer without the digit
splitting of its pre-tokenizer, so on numbers lm-eval's Hugging Face backend would see other token ids than
the server (tests/unit/test_default_model_reference.py), and the comparison would measure tokenizers.
"""
