"""The errors' messages: bad input starts with the field's name, a refusal to retry with `UNAVAILABLE: `,
so a client of Triton's /generate (HTTP 400 for every model error) can tell the two apart."""

from batchlm.errors import UNAVAILABLE_PREFIX, InvalidArgument, Unavailable


def test_bad_input_names_its_field_first():
    err = InvalidArgument("max_tokens", "must be >= 1, got 0")
    assert str(err) == "max_tokens: must be >= 1, got 0" and err.field == "max_tokens"


def test_a_refusal_to_retry_carries_the_stable_prefix():
    assert UNAVAILABLE_PREFIX == "UNAVAILABLE: "
    assert str(Unavailable("m is overloaded: 8 requests already waiting")) == \
        "UNAVAILABLE: m is overloaded: 8 requests already waiting"
    assert not str(InvalidArgument("text_input", "is required")).startswith(UNAVAILABLE_PREFIX)
