"""Takes a screenshot of the teaching page at / playing a short scene: the server on the default
model (2 workers, 1 thread each), 4 replies streaming, then a long prompt dropped in; the pointer
rests on the token that waited longest, so its explanation shows. Needs Debian's chromium and Playwright
(apt-get install -y chromium; pip install playwright).

    python scripts/screenshot_page.py --mode colocated --out docs/page.png
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "page.png"))
    ap.add_argument("--mode", default="colocated", choices=["colocated", "chunked", "disagg"])
    ap.add_argument("--streams", type=int, default=4, choices=[1, 2, 3, 4])
    ap.add_argument("--long-prompt", type=int, default=1500, choices=[500, 1500, 3000], help="about this many tokens")
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--width", type=int, default=1400, help="browser window width in pixels")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if not os.path.exists(args.chromium):
        sys.exit(f"no Chromium at {args.chromium} (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    from minipd.bench.server_process import ServerProcess

    extra = ["--model", args.model] if args.model else []
    server = ServerProcess("--workers", "2", "--threads-per-worker", "1", "--log-level", "warning", *extra)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": args.width, "height": 1000})
            page.goto(server.url + "/")
            page.click(f"[data-set-mode={args.mode}]")
            page.wait_for_selector(f"#mode[data-mode={args.mode}]", timeout=120_000)
            page.select_option("#n-streams", str(args.streams))
            page.select_option("#long-len", str(args.long_prompt))
            page.click("#start")
            page.wait_for_function(
                "[...document.querySelectorAll('.card')].every(c => +c.dataset.tokens >= 8)", timeout=60_000
            )
            page.click("#long")
            page.wait_for_function(
                "[...document.querySelectorAll('.card')].every(c => c.dataset.done === 'true')", timeout=300_000
            )
            page.wait_for_timeout(600)
            worst = page.evaluate("minipd.state.stalls.reduce((w, s, i, all) => (s.gap > all[w].gap ? i : w), 0)")
            point = page.evaluate(f"minipd.stallPoint({worst})")
            if point:
                page.mouse.move(point["x"], point["y"])
                page.wait_for_timeout(300)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out, full_page=True)
            stalls = page.get_attribute("#timeline", "data-stalls")
            browser.close()
        print(
            f"{args.out}: {args.mode}, {args.streams} replies and a ~{args.long_prompt}-token prompt; {stalls} late tokens"
        )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
