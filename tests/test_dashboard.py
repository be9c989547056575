"""The live dashboard at `/`, in a real browser: Debian's chromium driven by playwright.

A real swarm trains while the page polls the coordinator; the tests read what the page drew (the
peer table, the pipeline's stage columns and peer boxes, the number of points each chart path
holds, the event log) and disturb the swarm under it. No browser is downloaded: playwright drives
/usr/bin/chromium (`apt-get install chromium`; .ci/run installs it when it is missing).

Set DASHBOARD_SCREENSHOT=PATH to also save the full swarm, mid-training, as a PNG at PATH (that is
how docs/dashboard.png is made).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from coordinator.app import JoinInfo, create_app
from coordinator.view import ViewHolder, empty_view
from swarm.config import load_config
from tests.processes import start_coordinator
from tests.test_swarm import TINY, Swarm

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WIDTH, HEIGHT = 1280, 800
HTML_NAME = "<img src=x onerror=alert(1)>"

# Everything the page shows that the tests look at, read from the DOM in one go.
SNAPSHOT_JS = """() => {
  const text = (node, selector) => node.querySelector(selector)?.textContent ?? null;
  const points = (selector) => Number(document.querySelector(selector)?.dataset.points ?? 0);
  return {
    peers: [...document.querySelectorAll("#peers tbody tr")].map((r) => ({
      id: r.dataset.peerId, name: r.cells[0].textContent, stage: r.cells[2].textContent, state: r.dataset.state,
    })),
    stages: [...document.querySelectorAll("#pipeline section.stage")].map((s) => ({
      stage: Number(s.dataset.stage),
      bottleneck: s.classList.contains("bottleneck"),
      peers: [...s.querySelectorAll(".peer")].map((p) => ({
        id: p.dataset.peerId, state: p.dataset.state, name: text(p, ".name"),
      })),
    })),
    loss_points: points("#loss-chart path.series.s-loss"),
    speed_points: points("#speed-chart path.series.s-speed"),
    events: [...document.querySelectorAll("#events tbody tr")].map((r) => ({
      kind: r.dataset.kind, who: r.cells[2].textContent, text: r.cells[3].textContent,
    })),
    invites: [...document.querySelectorAll("#invites tbody tr")].map((r) => [...r.cells].map((c) => c.textContent)),
    run_id: text(document, "#run-id"),
    step: text(document, "#global-step"),
    spot: text(document, "#spot-checks"),
    freshness: text(document, "#freshness"),
    images: document.querySelectorAll("main img").length,
  };
}"""


class Dashboard:
    """The dashboard of one coordinator in a browser tab, and what went wrong in the tab."""

    def __init__(self, page: Page, url: str):
        self.page = page
        self.errors: list[str] = []  # uncaught script errors
        self.dialogs: list[str] = []  # alert(), confirm(), ... (the page opens none)
        page.on("pageerror", lambda err: self.errors.append(str(err)))
        page.on("dialog", self._dialog)
        page.goto(url)

    def _dialog(self, dialog) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def snapshot(self) -> dict:
        return self.page.evaluate(SNAPSHOT_JS)

    def wait(self, what: str, ok: Callable[[dict], bool], timeout: float) -> dict:
        """The first snapshot for which `ok` holds; fails naming `what` with the last one seen."""
        deadline = time.monotonic() + timeout
        while True:
            snap = self.snapshot()
            if ok(snap):
                return snap
            if time.monotonic() > deadline:
                raise AssertionError(f"the dashboard did not show {what} within {timeout} s; it showed {snap}")
            time.sleep(0.25)

    def screenshot(self, path: Path | str) -> None:
        self.page.screenshot(path=str(path), full_page=True)


def table_names(snap: dict) -> set[str]:
    return {p["name"] for p in snap["peers"]}


def box_names(snap: dict) -> set[str]:
    return {p["name"] for s in snap["stages"] for p in s["peers"]}


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
    yield context.new_page()
    context.close()


def test_dashboard_files_are_served_from_the_package():
    from fastapi.testclient import TestClient

    run = load_config(TINY)
    client = TestClient(create_app(run, ViewHolder(empty_view(run.stages.count)), JoinInfo(initial_peers=[])))
    index = client.get("/")
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    assert 'src="static/app.js"' in index.text and 'href="static/style.css"' in index.text
    assert 'from "./chart.js"' in client.get("/static/app.js").text
    for name, kind in [("app.js", "javascript"), ("chart.js", "javascript"), ("style.css", "text/css")]:
        response = client.get(f"/static/{name}")
        assert response.status_code == 200 and kind in response.headers["content-type"], name
    assert client.get("/static/missing.js").status_code == 404


def test_dashboard_follows_a_training_swarm_and_a_killed_peer(tmp_path, page):
    swarm = Swarm(tmp_path)
    try:
        for name, stage in [("a0", 0), ("a1", 1), ("b1", 1)]:
            swarm.add_peer(name, stage)
        online = swarm.wait_online(["a0", "a1", "b1"])
        ids = {p["public_name"]: p["peer_id"] for s in online["stages"] for p in s["peers"]}
        swarm.train(steps=60)
        dash = Dashboard(page, swarm.url)

        snap = dash.wait(
            "all three peers and 3 loss points",
            lambda s: {"a0", "a1", "b1"} <= table_names(s) and s["loss_points"] >= 3,
            timeout=180,
        )
        assert snap["run_id"] == "tiny"
        assert snap["speed_points"] >= 1
        assert {(p["name"], p["id"]) for p in snap["peers"]} == {(n, ids[n]) for n in ("a0", "a1", "b1")}
        assert [s["stage"] for s in snap["stages"]] == [0, 1]
        columns = {s["stage"]: {(p["name"], p["id"]) for p in s["peers"]} for s in snap["stages"]}
        assert columns == {0: {("a0", ids["a0"])}, 1: {("a1", ids["a1"]), ("b1", ids["b1"])}}
        assert all(p["state"] == "online" for s in snap["stages"] for p in s["peers"])
        assert sum(s["bottleneck"] for s in snap["stages"]) >= 1
        assert snap["freshness"].startswith("updated")
        # Two peers on stage 1: the trainer spot-checks each one's first answers against the other's.
        dash.wait("spot checks", lambda s: re.fullmatch(r"[1-9][\d,]* / [\d,]+ / [\d,]+", s["spot"]), timeout=30)
        if os.environ.get("DASHBOARD_SCREENSHOT"):
            dash.wait("10 loss points", lambda s: s["loss_points"] >= 10, timeout=180)
            dash.screenshot(os.environ["DASHBOARD_SCREENSHOT"])

        swarm.peers["b1"].stop(signal.SIGKILL)
        # its record expires within 12 s; the coordinator reads every second and the page polls every second
        dash.wait("b1 gone", lambda s: "b1" not in table_names(s) | box_names(s), timeout=30)
        snap = dash.wait(
            "b1's failure in the event log",
            lambda s: any(e["kind"] == "failure" and e["who"].split(" · ")[0] == "b1" for e in s["events"]),
            timeout=10,
        )
        assert {"a0", "a1"} <= table_names(snap) and box_names(snap) == {"a0", "a1"}
        joined = {e["who"].split(" · ")[0] for e in snap["events"] if e["kind"] == "join"}
        assert {"a0", "a1", "b1"} <= joined, snap["events"]
        dash.screenshot(tmp_path / "dashboard.png")
        assert not dash.errors and not dash.dialogs
    finally:
        swarm.close()


def test_a_peer_named_like_html_is_shown_as_text(tmp_path, page):
    swarm = Swarm(tmp_path)
    try:
        swarm.add_peer(HTML_NAME, 0)
        swarm.wait_online([HTML_NAME])
        dash = Dashboard(page, swarm.url)
        snap = dash.wait("the peer's row", lambda s: len(s["peers"]) == 1 and len(box_names(s)) == 1, timeout=30)
        assert snap["peers"][0]["name"] == HTML_NAME  # the cell's textContent: the name, as text
        assert box_names(snap) == {HTML_NAME}
        assert snap["images"] == 0  # nothing of the name was parsed as markup
        time.sleep(1.5)  # a few more polls and redraws
        assert not dash.dialogs, f"the page ran script from a peer's name: {dash.dialogs}"
        assert not dash.errors
    finally:
        swarm.close()


def test_the_invites_panel_lists_invites_and_never_a_token(tmp_path, page):
    operator = {"Authorization": "Bearer operator-secret"}
    coordinator, url = start_coordinator(TINY, tmp_path / "c.log", "--invite-only", "--token", "operator-secret")
    try:
        minted = httpx.post(f"{url}/api/v1/invites", json={"name": "erin", "max_peers": 2}, headers=operator, timeout=5)
        assert minted.status_code == 201, minted.text
        dash = Dashboard(page, url)
        dash.wait("erin's invite", lambda s: s["invites"] == [["erin", "0 / 2", "never", "active"]], timeout=10)
        assert page.is_hidden("#no-invites")
        assert minted.json()["token"] not in page.content()
        assert not dash.errors and not dash.dialogs
    finally:
        assert coordinator.stop() == 0
