"""Errors that carry the name of the field that was wrong.

`InvalidArgument` is bad input: a request field (prompt, max_tokens, ...) or a configuration key.
The serving layer maps it to Triton's INVALID_ARG (HTTP 400); anything else is an internal error.
"""


class InvalidArgument(ValueError):
    """A value the caller supplied is not acceptable; `field` names it.

    `str(err)` reads "<field>: <message>" so a client can see which input to fix.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# Every Unavailable's message starts with this, on every endpoint: Triton's /generate answers every model
# error with HTTP 400, so a client there tells a refusal it may retry from bad input (whose message starts
# with the field's name) by this prefix alone.
UNAVAILABLE_PREFIX = "UNAVAILABLE: "


class Unavailable(RuntimeError):
    """The model cannot take the request now (queue full, unloading); the client may retry.
    The serving layer maps it to Triton's UNAVAILABLE.

    `str(err)` reads "UNAVAILABLE: <message>": "... is overloaded: ..." when a queue is full, "... is
    unloading" or "... was unloaded ..." when the model is going away.
    """

    def __init__(self, message: str) -> None:
        super().__init__(UNAVAILABLE_PREFIX + message)


class TimedOut(Unavailable):
    """The request's own timeout (Triton's per-request `timeout`) passed before it finished: it left its
    batch or queue, its KV freed. UNAVAILABLE, as Triton answers a request whose timeout expired in its
    queue; `str(err)` reads "UNAVAILABLE: <model>: request timeout expired ...".
    """
