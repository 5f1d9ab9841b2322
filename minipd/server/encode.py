"""JSON for replies that can be large (a whole context's logprobs: megabytes): json.dumps holds the
event loop, and the GIL, for as long as it runs, so long lists are encoded a slice at a time and the
loop serves other clients between slices. The text is the same as json.dumps's. A long list's items
are encoded whole: in a reply they are tokens' rows, never long themselves."""

from __future__ import annotations

import asyncio
import json
import secrets

SLICE = 128  # list items encoded at once (each whole): about 6 ms for prompt_logprobs rows of 20


async def dumps_in_pieces(obj, ensure_ascii: bool = True) -> str:
    nonce = secrets.token_hex(8)  # names each long list's place in the skeleton; no text can guess it
    long_lists: list[list] = []

    def cut(x):
        if isinstance(x, list) and len(x) > SLICE:
            long_lists.append(x)
            return f"{nonce}-{len(long_lists) - 1}"
        if isinstance(x, dict) and any(isinstance(v, (dict, list)) for v in x.values()):
            return {k: cut(v) for k, v in x.items()}
        if isinstance(x, list) and any(isinstance(v, (dict, list)) for v in x):
            return [cut(v) for v in x]
        return x

    skeleton = cut(obj)
    text = json.dumps(skeleton, ensure_ascii=ensure_ascii)
    for k, items in enumerate(long_lists):
        parts = []
        for start in range(0, len(items), SLICE):
            await asyncio.sleep(0)
            parts.append(json.dumps(items[start : start + SLICE], ensure_ascii=ensure_ascii)[1:-1])
        text = text.replace(json.dumps(f"{nonce}-{k}"), "[" + ", ".join(parts) + "]", 1)
    return text
