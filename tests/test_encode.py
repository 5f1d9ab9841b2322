"""The reply encoder that yields between slices of long lists: the same text as json.dumps."""

from __future__ import annotations

import asyncio
import json
from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

from minipd.server import encode

leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5)
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=12) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
                      max_leaves=60)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(values, st.booleans())
def test_the_text_is_json_dumps_s_whatever_is_sliced(obj, ensure_ascii):
    with patch.object(encode, "SLICE", 3):  # lists of 4 items or more are sliced
        assert asyncio.run(encode.dumps_in_pieces(obj, ensure_ascii)) == json.dumps(obj, ensure_ascii=ensure_ascii)


def test_a_text_that_looks_like_a_placeholder_is_left_alone():
    obj = {"a": list(range(1000)), "b": "x-0", "c": [[1, 2]] * 300}
    assert asyncio.run(encode.dumps_in_pieces(obj)) == json.dumps(obj)
