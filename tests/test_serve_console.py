"""The web console in a real headless browser (Debian's chromium through chromedriver).

It loads, the route view lists both shards of a 2-shard fake route, a prompt typed into the
chat box streams an answer (several SSE chunks), and a screenshot is written to
build/serve-console.png. A gateway of several routes and models shows every route, which one
is out of service, and a model picker whose choice the chat uses.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")

from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from dgr.serve.server import Gateway  # noqa: E402
from fakeroute import start_fake  # noqa: E402

pytestmark = pytest.mark.native

REPO = Path(__file__).resolve().parent.parent


def _browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("the console test needs Debian's chromium and chromium-driver "
                    "(apt-get install chromium chromium-driver; ./quickstart.sh installs them)")
    opts = Options()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,800"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(executable_path=driver), options=opts)


@pytest.fixture(scope="module")
def route(native_bin):
    ws = [start_fake(native_bin, "--layers", r, "--fake-delay-ms", "5") for r in ("0:4", "4:8")]
    yield ws
    for w in ws:
        w.kill()


def test_console_streams_an_answer_and_shows_both_shards(route):
    browser = _browser()
    try:
        with Gateway([w.target for w in route], model_id="fake-8") as gw:
            browser.get(gw.url + "/")
            wait = WebDriverWait(browser, 30)
            rows = wait.until(lambda b: (r := b.find_elements(By.CSS_SELECTOR, "#route tbody tr[data-shard]"))
                              and len(r) == 2 and r)
            text = [r.text for r in rows]
            assert "[0:4)" in text[0] and "[4:8)" in text[1]
            assert route[0].target in text[0] and route[1].target in text[1]
            browser.find_element(By.ID, "prompt").send_keys("hello console")
            browser.find_element(By.ID, "send").click()
            # the answer streams: it grows over several reads before the request completes
            sizes = []
            wait.until(lambda b: sizes.append(len(b.find_elements(By.CSS_SELECTOR, ".msg.assistant span")[-1].text))
                       or b.find_element(By.ID, "send").is_enabled() and "chunks" in b.find_element(By.ID, "status").text)
            answer = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant span")[-1].text
            assert answer and "error" not in answer
            chunks = int(browser.find_element(By.ID, "status").text.split()[0])
            assert chunks > 1, "the answer arrived in one piece (not streamed)"
            # the route view keeps updating with live figures
            wait.until(lambda b: "running" in b.find_element(By.ID, "gw").text)
            out = REPO / "build" / "serve-console.png"
            out.parent.mkdir(parents=True, exist_ok=True)
            assert browser.save_screenshot(str(out))
            assert out.stat().st_size > 10_000
    finally:
        browser.quit()


def test_console_shows_every_route_and_picks_the_model(native_bin, route):
    import os
    import signal

    from dgr.serve.server import RouteSpec
    from fakeroute import poll

    whole = [start_fake(native_bin, "--fake-delay-ms", "5") for _ in range(2)]
    browser = _browser()
    try:
        specs = [RouteSpec(tuple(w.target for w in route), "split"), RouteSpec((whole[0].target,), "split"),
                 RouteSpec((whole[1].target,), "whole")]
        with Gateway(routes=specs, health_interval=0.2) as gw:
            browser.get(gw.url + "/")
            wait = WebDriverWait(browser, 30)
            heads = wait.until(lambda b: (r := b.find_elements(By.CSS_SELECTOR, "#route tbody tr.rt")) and len(r) == 3
                               and r)
            assert ["route-1 · split", "route-2 · split", "route-3 · whole"] == [h.text[:15] for h in heads]
            assert all("in service" in h.text for h in heads)
            assert len(browser.find_elements(By.CSS_SELECTOR, "#route tbody tr[data-shard]")) == 4
            options = [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#models option")]
            assert options == ["split", "whole"] and browser.find_element(By.ID, "models").is_displayed()
            browser.find_element(By.CSS_SELECTOR, "#models option:nth-child(2)").click()
            browser.find_element(By.ID, "prompt").send_keys("which model?")
            browser.find_element(By.ID, "send").click()
            wait.until(lambda b: b.find_element(By.ID, "send").is_enabled() and "chunks" in b.find_element(By.ID, "status").text)
            assert "error" not in browser.find_elements(By.CSS_SELECTOR, ".msg.assistant span")[-1].text
            got = gw.routes.view()
            assert [r["requests"] for r in got] == [0, 0, 1]     # the chat ran on the model picked
            os.kill(whole[0].proc.pid, signal.SIGSTOP)
            try:
                wait.until(lambda b: "out:" in b.find_elements(By.CSS_SELECTOR, "#route tbody tr.rt")[1].text)
            finally:
                os.kill(whole[0].proc.pid, signal.SIGCONT)
            poll(lambda: all(r.healthy for r in gw.routes.routes), 10, "route-2 back")
    finally:
        browser.quit()
        for w in whole:
            w.kill()
