"""python -m minipd trace: record a running server's events (GET /admin/events) as a Chrome trace
that https://ui.perfetto.dev opens.

    python -m minipd trace --url http://127.0.0.1:8000 --seconds 10 --out trace.json
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from minipd.cli_help import DefaultsFormatter, nonnegative_float, positive_float, server_url

READ_BUFSIZE = 2**22  # one SSE line (one event) may be this long, twice over


def add_trace_parser(sub) -> None:
    p = sub.add_parser("trace", help="record a running server's events as a Perfetto / Chrome trace",
                       description=__doc__.split("\n\n")[0], formatter_class=DefaultsFormatter)  # fmt: skip
    p.add_argument("--url", type=server_url, default="http://127.0.0.1:8000", help="the minipd server")
    p.add_argument("--api-key", default=os.environ.get("MINIPD_API_KEY"),
                   help="its API key, if it has one (default: none; env MINIPD_API_KEY)")  # fmt: skip
    p.add_argument("--seconds", type=positive_float, default=10.0, help="how long to read the event stream")
    since = p.add_mutually_exclusive_group()
    since.add_argument("--since", type=nonnegative_float, default=0.0,
                       help="replay the events the server kept from this epoch time on, then read the new ones "
                            "(default: 0, all it kept: the newest 32 MiB of events)")  # fmt: skip
    since.add_argument("--last", type=positive_float, default=None,
                       help="replay only the kept events of the last this many seconds (default: all kept)")  # fmt: skip
    p.add_argument("--title", default="minipd", help="the trace's title (in its otherData)")
    p.add_argument("--out", default="trace.json", help="where to write the trace")
    p.set_defaults(func=run)


def run(args) -> int:
    import aiohttp

    from minipd.trace.chrome import to_chrome_trace

    folder = os.path.dirname(os.path.abspath(args.out))  # checked before reading: a long read is not lost for it
    if os.path.isdir(args.out) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        print(f"minipd trace: cannot write {args.out} (no such folder, or not writable)", file=sys.stderr)
        return 2
    since = time.time() - args.last if args.last is not None else args.since
    try:
        events = asyncio.run(read_events(args.url.rstrip("/"), since, args.seconds, args.api_key))
    except (OSError, RuntimeError, aiohttp.ClientError) as err:
        print(f"minipd trace: could not read {args.url}/admin/events: {err}", file=sys.stderr)
        return 1
    trace = to_chrome_trace(events, title=args.title)
    with open(args.out, "w") as f:
        json.dump(trace, f, default=str)
    other = trace["otherData"]
    print(f"wrote {args.out}: {len(events)} events, {other['slices']} slices, {other['flows']} request flows"
          f" ({other['skipped']} events skipped); open it in https://ui.perfetto.dev")  # fmt: skip
    return 0


async def read_events(url: str, since: float, seconds: float, api_key: str | None = None) -> list[dict]:
    """GET /admin/events?since=... for `seconds`: the replayed events, then the new ones."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    events: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout, read_bufsize=READ_BUFSIZE) as session:
        async with session.get(f"{url}/admin/events", params={"since": repr(since)}, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")

            async def read() -> None:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        events.append(json.loads(line[6:]))

            try:
                await asyncio.wait_for(read(), seconds)
            except asyncio.TimeoutError:
                pass
    return events
