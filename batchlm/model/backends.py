"""The names of the compute paths a model can run: the native kernels, or the torch (oneDNN) fallbacks.

EngineConfig validates its `attention`, `linear` and `pointwise` fields against these, and the model
picks its kernels by them; "auto" uses a kernel where it is built and can run (batchlm.kernels).
Imports nothing but the errors, so the engine's configuration reads them without loading torch.
"""

from batchlm.errors import InvalidArgument

ATTENTION_BACKENDS = ("auto", "kernel", "torch")
LINEAR_BACKENDS = ("auto", "kernel", "onednn")
POINTWISE_BACKENDS = ("auto", "kernel", "torch")
# GGUF Q4_0/Q4_1/Q8_0/F16/BF16 tensors kept as stored where they can run, or dequantized (load_model)
WEIGHTS_CHOICES = ("auto", "dense")
# what the kept tensors multiply: float32 activations (exact); or, faster and not exact, activations rounded
# to int8 per block of 32 against Q4_0/Q4_1/Q8_0 (batchlm::linear_q8), or rounded to bfloat16 against BF16
# (batchlm::linear_bf16)
ACTIVATIONS_CHOICES = ("float32", "int8", "bfloat16")


def check_weights(weights: str, activations: str) -> None:
    """Raises InvalidArgument naming the field unless `weights` and `activations` are choices that go together
    (EngineConfig and load_model both take them)."""
    if weights not in WEIGHTS_CHOICES:
        raise InvalidArgument("weights", f"must be one of {WEIGHTS_CHOICES}, got {weights!r}")
    if activations not in ACTIVATIONS_CHOICES:
        raise InvalidArgument("activations", f"must be one of {ACTIVATIONS_CHOICES}, got {activations!r}")
    if activations != "float32" and weights == "dense":
        raise InvalidArgument("activations", f"{activations} multiplies the file's blocks as stored: needs weights "
                              "'auto'")
