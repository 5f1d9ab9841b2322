"""The teaching page at / in a real headless Chromium (Debian's `chromium`, driven by Playwright),
against a real server: replies stream, the mode button switches the mode, and in colocated a long
prompt's prefill freezes the replies on its worker, which the page marks as stalls and explains."""

from __future__ import annotations

import os
import shutil
import urllib.error
import urllib.request

import pytest

from minipd.bench.server_process import ServerProcess
from tests.helpers import serving

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
ALL_REPLIES_GOING = "[...document.querySelectorAll('.card:not(.long)')].every(c => +c.dataset.tokens >= 5)"
ALL_DONE = "[...document.querySelectorAll('.card')].every(c => c.dataset.done === 'true')"


@pytest.fixture
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs Playwright (pip install playwright)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def open_page(browser, url: str):
    """A page that records every console error and uncaught exception."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.errors = []
    page.on("console", lambda msg: page.errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: page.errors.append(f"uncaught: {exc}"))
    page.goto(url + "/")
    return page


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_page_shows_the_stall_and_explains_it(browser, tmp_path):
    with serving("--workers", "2", "--threads-per-worker", "1", "--mode", "chunked", "--chunk-tokens", "64") as server:
        assert status_of(server.url + "/static/app.js") == 200
        for bad in ("/static/..%2Fapp.py", "/static/%2E%2E%2Fapp.py", "/static/nothing.js", "/static/"):
            assert status_of(server.url + bad) == 404, bad

        page = open_page(browser, server.url)
        page.wait_for_selector("#mode[data-mode=chunked]", timeout=30_000)  # the page shows GET /admin/mode
        page.click("[data-set-mode=colocated]")
        page.wait_for_selector("#mode[data-mode=colocated]", timeout=120_000)
        assert server.get("/admin/mode") == (200, {"mode": "colocated"})

        page.click("#start")  # 4 replies (the default)
        page.wait_for_function(ALL_REPLIES_GOING, timeout=60_000)
        assert page.locator(".card").count() == 4
        page.click("#long")  # ~1500 tokens: prefilled whole on one worker, in one step of seconds
        page.wait_for_function(ALL_DONE, timeout=180_000)
        page.wait_for_timeout(500)  # the last events and a redraw

        cards = page.locator(".card:not(.long)")
        for i in range(cards.count()):
            card = cards.nth(i)
            assert int(card.get_attribute("data-tokens")) >= 100, card.inner_text()
            assert card.locator(".text").inner_text().strip()
            assert "server" in card.locator(".stats").inner_text()  # the usage chunk's timeline arrived
        long_card = page.locator(".card.long").inner_text()
        assert "prefill" in long_card and "prompt 1," in long_card, long_card  # ~1,500 prompt tokens

        stalls = int(page.get_attribute("#timeline", "data-stalls"))
        assert stalls > 0
        # the freeze is explained by the worker step that read the long prompt, in one piece
        explained = page.locator("#stall-list li[data-cause=prefill]", has_text="of the long prompt")
        assert explained.count() >= 1, page.inner_text("#stall-list")
        assert "step reading 1," in explained.first.inner_text(), page.inner_text("#stall-list")

        # pointing at the longest wait's late token names what it waited behind
        worst = page.evaluate("minipd.state.stalls.reduce((w, s, i, all) => (s.gap > all[w].gap ? i : w), 0)")
        point = page.evaluate(f"minipd.stallPoint({worst})")
        page.mouse.move(point["x"], point["y"])
        page.wait_for_selector("#tip:not([hidden])", timeout=5_000)
        tip = page.inner_text("#tip")
        assert "waited behind worker" in tip and "prompt tokens of the long prompt" in tip, tip

        shot = tmp_path / "page.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 20_000
        if os.environ.get("MINIPD_SCREENSHOT"):
            shutil.copyfile(shot, os.environ["MINIPD_SCREENSHOT"])
        assert page.errors == []
        page.close()


def test_page_asks_for_the_api_key_and_sends_it(browser):
    server = ServerProcess("--model", "tiny-random", "--workers", "1", "--api-key", "sesame")
    try:
        page_with_a_key(browser, server)  # / and /static/* are open; /v1 and /admin need the key
    finally:
        server.stop()
    assert server.leftovers() == ([], [])


def page_with_a_key(browser, server: ServerProcess) -> None:
    assert status_of(server.url + "/") == 200 and status_of(server.url + "/static/style.css") == 200
    page = open_page(browser, server.url)
    page.wait_for_selector("#message.error", timeout=30_000)
    assert "API key" in page.inner_text("#message")
    page.fill("#api-key", server.api_key)
    page.dispatch_event("#api-key", "change")
    page.wait_for_selector("#mode[data-mode=colocated]", timeout=30_000)
    assert page.evaluate("localStorage.getItem('minipd.apiKey')") == server.api_key
    page.select_option("#n-streams", "1")
    page.click("#start")
    page.wait_for_function(ALL_DONE, timeout=60_000)
    assert int(page.locator(".card").first.get_attribute("data-tokens")) > 0
    # the only errors are the browser's own notes on the 401s before the key was given
    assert all("401" in e for e in page.errors), page.errors
    page.close()
