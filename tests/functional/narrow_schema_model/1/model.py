"""text_only: answers `max_tokens` words (" w0 w1 ..."), one response per word when `stream` is true,
else one answer. Only `text_output` comes back: no finish reason, no token counters."""

import numpy as np
import triton_python_backend_utils as pb_utils


def _scalar(request, name, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0]


def _text(text: str):
    return pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))])


class TritonPythonModel:
    def execute(self, requests):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            sender = request.get_response_sender()
            words = [f" w{i}" for i in range(int(_scalar(request, "max_tokens")))]
            if bool(_scalar(request, "stream", False)):
                for word in words:
                    sender.send(_text(word))
                sender.send(flags=final)
            else:
                sender.send(_text("".join(words)), flags=final)
        return None
