"""The no-op values of the fields kvgate's workers refuse (workers/unsupported.py), compared as
JSON holds them (workers/fields.json_equal): a bool is no number and a number no bool, while an
integer and a float of one value are one number."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.fields import json_equal
from workers.prompt_options import prompt_options
from workers.sampling_params import InvalidRequest
from workers.unsupported import NOOP_VALUES, refuse_unsupported

# Few values of each type, so that two drawn values are often equal, or equal but for their type.
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-1, 2)
    | st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5])
    | st.sampled_from(["", "a", "0"])
)
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("ab"), inner, max_size=2)
)


def typed(v: object) -> object:
    """`v` as a value that equals another's exactly when JSON's types and values do."""
    if v is None:
        return ("null",)
    if isinstance(v, bool):
        return ("bool", v)
    if isinstance(v, (int, float)):
        return ("number", Fraction(v))
    if isinstance(v, str):
        return ("string", v)
    if isinstance(v, list):
        return ("array", tuple(map(typed, v)))
    assert isinstance(v, dict)
    return ("object", frozenset((k, typed(x)) for k, x in v.items()))


@settings(max_examples=400, deadline=None)
@given(VALUES, VALUES)
def test_json_equal_is_equality_of_json_types_and_values(a, b):
    assert json_equal(a, b) == (typed(a) == typed(b))
    assert json_equal(a, a) and json_equal(b, a) == json_equal(a, b)


# (field, kind, value): not the field's no-op, though Python's == says it is.
NOT_NOOPS = [
    ("priority", "completion", False),
    ("priority", "chat", False),
    ("echo", "chat", 0),
    ("return_tokens_as_token_ids", "chat", 0),
    ("return_prompt_text", "completion", 0.0),
    ("use_beam_search", "completion", 0),
    ("watermarking", "completion", 0.0),
    ("length_penalty", "completion", True),
    ("length_penalty", "chat", True),
    ("best_of", "completion", True),
    ("watermarking", "chat", 0),
    ("top_logprobs", "completion", False),
    ("stream_interval", "chat", True),
    ("include_reasoning", "chat", 1),
    ("response_format", "chat", {"type": "text", "strict": False}),
    ("tools", "chat", [False]),
]
# (field, kind, value): the field's no-op, as an integer or a float alike.
NOOPS = [
    ("priority", "chat", 0),
    ("priority", "completion", 0.0),
    ("priority", "chat", -0.0),
    ("length_penalty", "completion", 1.0),
    ("routed_experts_prompt_start", "chat", 0.0),
    ("best_of", "completion", 1.0),
    ("thinking_token_budget", "chat", -1),
    ("echo", "chat", False),
    ("include_reasoning", "completion", True),
    ("response_format", "chat", {"type": "text"}),
    ("tool_choice", "chat", "none"),
    ("mm_processor_kwargs", "chat", {}),
]


@pytest.mark.parametrize("name, kind, value", NOT_NOOPS)
def test_a_value_of_another_json_type_is_no_no_op(name, kind, value):
    assert name in NOOP_VALUES
    with pytest.raises(InvalidRequest) as e:
        refuse_unsupported({name: value}, kind)
    assert e.value.param == name and e.value.code == "unsupported_parameter"


@pytest.mark.parametrize("name, kind, value", NOOPS)
def test_the_no_op_values_pass_as_integers_or_floats(name, kind, value):
    refuse_unsupported({name: value}, kind)


@pytest.mark.parametrize("name, value", [("chat_template_kwargs", {"a": 0}), ("documents", False)])
def test_a_text_prompt_compares_the_chat_fields_defaults_the_same_way(name, value):
    with pytest.raises(InvalidRequest) as e:
        prompt_options({name: value}, "completion")
    assert e.value.param == name
