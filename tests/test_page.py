"""The teaching page at / in a real headless Chromium (Debian's `chromium`, driven by Playwright),
against a real server: replies stream, the mode button switches the mode, and in colocated a long
prompt's prefill freezes the replies on its worker, which the page marks as stalls and explains.
A mode button pressed while replies stream changes the worker lanes at once, and the timeline
draws the switch and every reply that moved (with where its KV went)."""

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
        status, mode = server.get("/admin/mode")
        assert status == 200 and mode["mode"] == "colocated" and mode["last_switch"]["changed"], mode

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


def test_a_mode_button_while_replies_stream_moves_them_and_the_page_draws_it(browser):
    """Colocated on 2 workers, 4 replies streaming (slowed to ~50 ms a token, so they outlive the switch)
    and a long prompt just sent: "disagg (1P + 1D)" makes worker 0 a prefill worker, so the replies on it
    move to worker 1. The lanes show the new roles while the replies still stream; the timeline draws
    the switch (its label, its duration, what moved) and one arrow per moved reply from worker 0 to
    worker 1; the cards say where each moved reply's KV went; every reply still gets all its tokens.
    With 5 streams and the event feed the browser's 6 connections are taken: the feed gives its own
    up for the switch and replays what it missed (the moves are drawn from the feed's events)."""
    with serving("--model", "tiny-random", "--workers", "2", "--threads-per-worker", "1", "--mode", "colocated",
                 env={"MINIPD_FAULTS": "slow_step_s=0.05"}) as server:  # fmt: skip
        page = open_page(browser, server.url)
        page.wait_for_selector("#mode[data-mode=colocated]", timeout=30_000)
        page.click("#start")  # 4 replies of 120 tokens
        page.wait_for_function(ALL_REPLIES_GOING, timeout=30_000)
        page.select_option("#long-len", "3000")
        page.click("#long")
        assert page.is_enabled("[data-set-mode=disagg]")  # a switch no longer waits for the replies
        running = "minipd.state.streams.filter(s => !s.done).length"
        crowded = page.evaluate(f"window.feedBefore = minipd.state.feed; {running}")
        page.click("[data-set-mode=disagg]")

        # at once: the lanes take the new roles while the replies still stream
        page.wait_for_function("minipd.state.workers.map(w => w.role).join() === 'prefill,decode'", timeout=10_000)
        assert page.evaluate(f"!({ALL_DONE})"), "the replies ended before the lanes changed"
        page.wait_for_selector("#mode[data-mode=disagg]", timeout=10_000)

        # the switch and its moves on the timeline, on the steps' time axis
        page.wait_for_function("minipd.drawn().some(d => d.kind === 'switch' && d.detail.includes('moved'))",
                               timeout=20_000)  # fmt: skip
        page.wait_for_function("+document.getElementById('timeline').dataset.moves >= 1", timeout=20_000)
        page.wait_for_function(ALL_DONE, timeout=60_000)
        page.wait_for_timeout(300)  # a redraw
        if crowded == 5:
            assert page.evaluate("window.feedBefore !== minipd.state.feed")  # the feed gave way and came back

        drawn = page.evaluate("minipd.drawn()")
        switches = [d for d in drawn if d["kind"] == "switch"]
        assert len(switches) == 1, switches
        sw = switches[0]
        assert sw["label"] == "→ disagg 1P1D" and sw["roles"] == ["prefill", "decode"], sw
        answer = server.get("/admin/mode")[1]["last_switch"]
        assert answer["changed"] and answer["moved"] >= 1, answer
        assert sw["detail"].startswith(page.evaluate(f"fmtS({answer['seconds']})")), (sw, answer)
        assert f"moved {answer['moved']} (" in sw["detail"], (sw, answer)
        moves = [d for d in drawn if d["kind"] == "move"]
        assert len([m for m in moves if m["outcome"] == "moved"]) == answer["moved"], moves
        assert all((m["from"], m["to"]) == (0, 1) for m in moves if m["outcome"] == "moved"), moves
        steps = page.evaluate("[...minipd.state.steps.values()].map(s => [s.time, s.end])")
        assert min(t for t, _ in steps) < sw["time"] < max(e for _, e in steps)  # one time axis with the steps
        assert sw["x"] > 150  # inside the plot, right of the lane names

        # the moved replies say where their KV went; none lost a token
        cards = page.locator(".card")
        moved_cards = [cards.nth(i) for i in range(cards.count()) if cards.nth(i).get_attribute("data-moved")]
        assert len(moved_cards) == answer["moved"], [cards.nth(i).inner_text() for i in range(cards.count())]
        for card in moved_cards:
            assert card.get_attribute("data-moved") == "0→1"
            assert "worker 0 → 1" in card.locator(".stats").inner_text() and "moved" in card.inner_text()
        assert page.evaluate("minipd.state.streams.map(s => s.timeline.output_tokens)") == [120] * 4 + [8]
        assert page.evaluate("minipd.state.handoffs.size") == 0  # a move's KV transfer is drawn as the move
        assert "moved to another worker" in page.inner_text("#message"), page.inner_text("#message")
        assert page.errors == []
        page.close()
