"""JSON for replies that can be large (a whole context's logprobs: megabytes): json.dumps holds the
event loop, and the GIL, for as long as it runs, so long lists are encoded a slice at a time and the
loop serves other clients between slices. The text is the same as json.dumps's. A long list's items
are encoded whole: in a reply they are tokens' rows, never long themselves."""

from __future__ import annotations

import asyncio
import json

SLICE = 128  # list items encoded at once (each whole): about 6 ms for prompt_logprobs rows of 20


async def dumps_in_pieces(obj, ensure_ascii: bool = True) -> str:
    out: list[str] = []
    await _encode(obj, out, ensure_ascii)
    return "".join(out)


def _has_long_list(x) -> bool:
    if isinstance(x, list):
        return len(x) > SLICE or any(isinstance(v, (list, dict)) and _has_long_list(v) for v in x)
    if isinstance(x, dict):
        return any(isinstance(v, (list, dict)) and _has_long_list(v) for v in x.values())
    return False


async def _encode(x, out: list[str], ensure_ascii: bool) -> None:
    if not _has_long_list(x):
        out.append(json.dumps(x, ensure_ascii=ensure_ascii))
    elif isinstance(x, dict):
        out.append("{")
        for i, (key, value) in enumerate(x.items()):
            pair = json.dumps({key: None}, ensure_ascii=ensure_ascii)  # the key as json.dumps writes it
            out.append((", " if i else "") + pair[1 : -len("null}")])
            await _encode(value, out, ensure_ascii)
        out.append("}")
    elif len(x) > SLICE:
        out.append("[")
        for start in range(0, len(x), SLICE):
            await asyncio.sleep(0)
            out.append((", " if start else "") + json.dumps(x[start : start + SLICE], ensure_ascii=ensure_ascii)[1:-1])
        out.append("]")
    else:
        out.append("[")
        for i, value in enumerate(x):
            out.append(", " if i else "")
            await _encode(value, out, ensure_ascii)
        out.append("]")
