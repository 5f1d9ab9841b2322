"""The reply encoder that yields between slices of long lists: the same text as json.dumps."""

from __future__ import annotations

import asyncio
import json
from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

from minipd.server import encode

leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)
keys = st.text(max_size=3) | st.integers() | st.booleans() | st.none() | st.floats()
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=12) | st.dictionaries(keys, inner, max_size=4),
                      max_leaves=60)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(values, st.booleans())
def test_the_text_is_json_dumps_s_whatever_is_sliced(obj, ensure_ascii):
    with patch.object(encode, "SLICE", 3):  # lists of 4 items or more are sliced
        assert asyncio.run(encode.dumps_in_pieces(obj, ensure_ascii)) == json.dumps(obj, ensure_ascii=ensure_ascii)
