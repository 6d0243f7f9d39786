"""A hypothesis strategy of any JSON value, as a hostile client may send one in a field."""

from hypothesis import strategies as st


def json_values(max_leaves: int, max_items: int = 3) -> st.SearchStrategy:
    """Null, booleans, integers, finite floats and short strings, nested in lists and objects."""
    return st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=max_items) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
        max_leaves=max_leaves,
    )
