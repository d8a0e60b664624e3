"""The node's web page in a real browser (Debian's chromium driven by Playwright).

A small local network (2 node processes, 2 blocks) serves the page; the browser opens the page of
the node holding block 1, sees every block with a holder, generates text through the chain from
the playground, reads it back from the page, and checks a phone-sized viewport has no horizontal
overflow. Any failed request, unexpected 4xx/5xx response or console error fails the test.
Screenshots land in the test's tmp dir (``dashboard.png``, ``dashboard-phone.png``).
"""
from __future__ import annotations

import os
import time

import pytest

from blocktrain.node.swarm.launcher import LocalSwarm
from blocktrain.node.swarm.run import SWARM_DEFAULTS

from test_utils.configs import TEST_CORPUS

pytestmark = [pytest.mark.network, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
# train briefly (the loss chart gets data), then just serve: keeps the test light on a small machine;
# no averaging rounds (each block has a single holder anyway)
NODE_ARGS = ["--max-steps", "150", "--average-every", "1000000", "--average-period", "1e9", "--average-clock", "0"]


def _need_browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} not found (install Debian's chromium: apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright  # noqa: F401
    except ImportError:
        pytest.skip("the playwright Python package is not installed (pip install playwright)")


class PageWatch:
    """Collects failed requests, error responses and console errors of every page it watches."""

    def __init__(self):
        self.problems: list[str] = []
        self.allowed: list[tuple[str, int]] = []   # (path suffix, status) provoked on purpose

    def allow(self, path: str, status: int) -> None:
        self.allowed.append((path, status))

    def _is_allowed(self, url: str, status: int) -> bool:
        base = url.split("?", 1)[0]
        return any(base.endswith(p) and status == s for p, s in self.allowed)

    def attach(self, page) -> None:
        page.on("requestfailed", lambda r: self.problems.append(
            f"request failed: {r.method} {r.url}: {r.failure}"))
        page.on("response", lambda r: r.status >= 400 and not self._is_allowed(r.url, r.status)
                and self.problems.append(f"HTTP {r.status} for {r.request.method} {r.url}"))
        page.on("console", self._console)
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))

    def _console(self, msg) -> None:
        if msg.type != "error":
            return
        # Chrome logs every 4xx/5xx as "Failed to load resource"; a deliberate one is not a problem
        url = (msg.location or {}).get("url", "")
        if "Failed to load resource" in msg.text and any(
                url.split("?", 1)[0].endswith(p) and f"status of {s}" in msg.text for p, s in self.allowed):
            return
        self.problems.append(f"console error: {msg.text} ({url})")

    def check(self) -> None:
        assert not self.problems, "the page had problems:\n" + "\n".join(self.problems)


def _no_horizontal_overflow(page) -> tuple[int, int]:
    return page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")


def test_dashboard_and_playground_in_a_real_browser(tmp_path):
    _need_browser()
    data = TEST_CORPUS
    from playwright.sync_api import sync_playwright

    t0 = time.monotonic()
    sw = LocalSwarm(tmp_path / "swarm", run_id="webtest", overrides=SWARM_DEFAULTS + ["n_blocks=2"],
                    data=str(data), extra_args=["--device", "cpu"])
    try:
        sw.start_seed(block=0, args=NODE_ARGS)
        node = sw.start_join(block=1, args=NODE_ARGS, wait=False)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)   # while node 1 boots
            try:
                node.wait_ready()
                peers = {n.info["peer_id"]: n for n in sw.nodes}
                print(f"swarm up after {time.monotonic() - t0:.0f}s")

                # ---- desktop ------------------------------------------------------------------------
                ctx = browser.new_context(viewport={"width": 1200, "height": 900})
                page = ctx.new_page()
                watch = PageWatch()
                watch.attach(page)
                resp = page.goto(node.url + "/")
                assert resp is not None and resp.status == 200
                assert page.title() == "BlockTrain node"
                # every block listed with a live holder, this node highlighted in block 1
                page.wait_for_function(
                    """() => { const rows = document.querySelectorAll('#blocks .block-row');
                               return rows.length === 2 && [...rows].every(r => +r.dataset.holders >= 1); }""",
                    timeout=60_000)
                assert page.locator('#blocks .block-row[data-block="1"] .holder.is-self').count() == 1
                assert page.locator('#blocks .block-row[data-block="0"] .holder.is-self').count() == 0
                assert page.locator('#blocks .block-row[data-block="0"] .holder').get_attribute(
                    "data-peer") == sw.nodes[0].info["peer_id"]
                assert page.locator("#run-id").text_content() == "webtest"
                assert "2 blocks" in page.locator("#run-config").text_content()
                assert page.locator("#self-block").text_content() == "1"
                # the loss chart is a real SVG chart with data (client-side history of /v1/status)
                page.wait_for_function("() => +document.querySelector('#loss-chart').dataset.points > 10",
                                       timeout=60_000)
                assert page.locator("#loss-chart svg path.series").count() >= 1
                assert page.locator("#steps-chart svg path.series").count() == 2
                assert page.locator("#pipe-card").is_hidden()   # a paper run: no training along the chain
                # its periodic checkpoint (every 100 steps) is shown with its step
                page.wait_for_function("() => document.querySelector('#self-checkpoint').textContent"
                                       ".startsWith('step 100 at ')", timeout=60_000)

                # ---- playground ---------------------------------------------------------------------
                page.get_by_label("Prompt").fill("The city of ")
                page.get_by_label("Mode").select_option("one_sweep")
                page.get_by_label("Max bytes").fill("24")
                with page.expect_response(lambda r: r.url.endswith("/v1/generate"), timeout=120_000) as gen:
                    page.get_by_role("button", name="Generate").click()
                assert gen.value.status == 200, gen.value.text()
                out = gen.value.json()
                page.wait_for_selector("#gen-result:not([hidden])", timeout=30_000)
                shown = page.locator("#gen-text").text_content()
                assert shown == out["text"] and out["bytes_generated"] == 24 and len(shown) > 0
                assert page.locator("#gen-prompt").text_content() == "The city of "
                hops = page.locator("#gen-route li[data-block]")
                blocks = [hops.nth(i).get_attribute("data-block") for i in range(hops.count())]
                assert blocks == ["0", "1"], blocks
                for i in range(hops.count()):
                    assert hops.nth(i).get_attribute("title") in peers
                    assert "block" in hops.nth(i).text_content()
                meta = page.locator("#gen-meta").text_content()
                assert "ms" in meta and "1 traversal" in meta, meta
                assert page.locator("#gen-error").is_hidden()
                page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)

                # a refused request is shown readably (the API's 422 detail), not swallowed
                watch.allow("/v1/generate", 422)
                page.get_by_label("Max bytes").fill("5000")
                with page.expect_response(lambda r: r.url.endswith("/v1/generate")) as bad:
                    page.get_by_role("button", name="Generate").click()
                assert bad.value.status == 422
                err = page.locator("#gen-error")
                err.wait_for(state="visible", timeout=10_000)
                assert "422" in err.text_content() and "max_bytes" in err.text_content()
                # an empty length leaves it to the node: the default for this run and mode, which the
                # page shows with the mode's limit (GET v1/status run.generate)
                limits = node.get("/v1/status")["run"]["generate"]["one_sweep"]
                assert f"at most {limits['max']} bytes" in page.locator("#max-hint").text_content()
                page.get_by_label("Max bytes").fill("")
                with page.expect_response(lambda r: r.url.endswith("/v1/generate"), timeout=120_000) as dflt:
                    page.get_by_role("button", name="Generate").click()
                assert dflt.value.status == 200, dflt.value.text()
                assert "max_bytes" not in dflt.value.request.post_data_json
                assert dflt.value.json()["bytes_generated"] == limits["default"]
                page.wait_for_selector("#gen-error[hidden]", state="attached", timeout=30_000)
                page.get_by_label("Max bytes").fill("24")
                page.wait_for_timeout(2500)   # one more refresh cycle with no errors

                w, iw = _no_horizontal_overflow(page)
                assert w <= iw, f"desktop page overflows horizontally: {w} > {iw}"
                watch.check()
                ctx.close()

                # ---- phone-sized viewport -----------------------------------------------------------
                ctx = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True,
                                          has_touch=True, device_scale_factor=2)
                phone = ctx.new_page()
                watch = PageWatch()
                watch.attach(phone)
                phone.goto(node.url + "/")
                phone.wait_for_function(
                    "() => document.querySelectorAll('#blocks .block-row .holder').length >= 2", timeout=30_000)
                phone.get_by_label("Prompt").fill("A_long_prompt_without_any_spaces_")
                phone.get_by_label("Max bytes").fill("16")
                phone.get_by_role("button", name="Generate").click()
                phone.wait_for_selector("#gen-result:not([hidden]), #gen-error:not([hidden])", timeout=120_000)
                assert phone.locator("#gen-error").is_hidden(), phone.locator("#gen-error").text_content()
                assert phone.locator("#gen-text").text_content()
                phone.wait_for_function("() => +document.querySelector('#loss-chart').dataset.points > 10",
                                        timeout=30_000)
                w, iw = _no_horizontal_overflow(phone)
                assert iw == 390 and w <= iw, f"phone page overflows horizontally: {w} > {iw}"
                phone.screenshot(path=str(tmp_path / "dashboard-phone.png"), full_page=True)
                watch.check()
                ctx.close()
            finally:
                browser.close()
        print(f"screenshots: {tmp_path / 'dashboard.png'} {tmp_path / 'dashboard-phone.png'} "
              f"({time.monotonic() - t0:.0f}s)")
    finally:
        sw.stop_all()


def test_a_pipeline_runs_chain_card_in_a_real_browser(tmp_path):
    """A ``pipeline`` run (2 blocks): block 0's page counts its micro-batches and shows its time
    budget per micro-batch; the last block's page shows the calls it served."""
    _need_browser()
    from playwright.sync_api import sync_playwright

    sw = LocalSwarm(tmp_path / "swarm", run_id="webpipe", data=str(TEST_CORPUS),
                    overrides=["objective=pipeline", *SWARM_DEFAULTS, "n_blocks=2"],
                    extra_args=["--device", "cpu", "--pipeline-timeout", "30", "--pipeline-timeout-max", "90"])
    try:
        last = sw.start_seed(block=1, args=NODE_ARGS)
        first = sw.start_join(block=0, args=NODE_ARGS)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_context(viewport={"width": 1200, "height": 900}).new_page()
                watch = PageWatch()
                watch.attach(page)
                page.goto(first.url + "/")
                page.wait_for_function("() => { const t = document.querySelector('#pipe-completed').textContent;"
                                       " return /^[0-9][0-9,]*$/.test(t) && +t.replace(/,/g, '') >= 5; }",
                                       timeout=90_000)
                assert page.locator("#pipe-card").is_visible()
                assert "block 0: reads data, sends micro-batches" in page.locator("#pipe-role").text_content()
                b = first.get("/v1/status")["self"]["pipeline"]["budget"]
                assert b["floor_s"] == 30.0 and b["ceiling_s"] == 90.0
                page.wait_for_function("() => document.querySelector('#pipe-budget').textContent"
                                       ".includes('per micro-batch (from 30, at most 90; round trip ')", timeout=30_000)
                assert page.locator("#pipe-lost").text_content()[:1].isdigit()
                page.locator("#pipe-card").screenshot(path=str(tmp_path / "pipeline-card.png"))
                page.goto(last.url + "/")
                page.wait_for_function("() => document.querySelector('#pipe-served').textContent"
                                       ".includes(' answered')", timeout=30_000)
                assert "last block" in page.locator("#pipe-role").text_content()
                assert page.locator("#pipe-budget").text_content() == "set by block 0's holder"
                assert page.locator("#pipe-completed").text_content() == "\u2013"
                page.locator("#pipe-card").screenshot(path=str(tmp_path / "pipeline-card-last.png"))
                page.wait_for_timeout(1500)
                watch.check()
            finally:
                browser.close()
    finally:
        sw.stop_all()
