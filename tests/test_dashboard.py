"""The swarm's dashboard in a real headless browser (Chromium and chromedriver from Debian's packages, driven by
Selenium): a 3-peer swarm on loopback, watched by an observer's ``python -m peer status --serve``. The page lists
the three peers, their epochs advance on the page without a reload, and a killed peer turns stale. A running
peer's ``--dashboard`` serves the same snapshot."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.harness.swarm import ROOT, Proc, Swarm, signal_group, wait_until

CHROMIUM, DRIVER = shutil.which("chromium") or "/usr/bin/chromium", shutil.which("chromedriver") or \
    "/usr/bin/chromedriver"
SCREENSHOT = os.environ.get("DASHBOARD_SCREENSHOT")  # where to keep the page's picture (docs/dashboard.png)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def browser():
    if not (Path(CHROMIUM).exists() and Path(DRIVER).exists()):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(DRIVER), options=options)


READ_ROWS = """return [...document.querySelectorAll('#peers tbody tr')].map(tr => [tr.dataset.peer,
    tr.querySelector('td.epoch').textContent, tr.querySelector('td.health').textContent, tr.className]);"""


def rows(driver):
    """{peer id: (epoch, health, row class)} as the page shows them now: read in one script, since the page
    rebuilds its table at every refresh (an element found in one call may be gone by the next)."""
    return {peer: (int(epoch), health, kind) for peer, epoch, health, kind in driver.execute_script(READ_ROWS)}


def row(peer, epoch, loss, **fields):
    return dict(dict(peer_id=peer, epoch=epoch, loss=loss, bytes_per_round=1000 * epoch, group_size=2,
                     eval_loss=None, eval_epoch=-1), **fields)


def test_the_server_serves_the_page_the_snapshot_and_the_history_it_has_seen():
    """In process, on a loopback socket: the snapshot as taken, and a history per peer and epoch that keeps
    what each snapshot showed (the last look at an epoch wins, an eval lands at its own epoch)."""
    from peer.ops.dashboard import Dashboard

    snapshots = iter([dict(run_id="r", peers=[row("a", 1, 3.0), row("b", 1, 3.1)], forks={}),
                      dict(run_id="r", peers=[row("a", 2, 2.5, eval_loss=2.7, eval_epoch=2), row("b", 1, 3.05)],
                           forks={})])
    taken = []

    def take():
        taken.append(next(snapshots))
        return taken[-1]

    dashboard = Dashboard(take, port=0, refresh=0.05).start()
    try:
        wait_until(lambda: len(taken) == 2 or None, 10, "two snapshots")
        get = lambda path: urllib.request.urlopen(dashboard.url + path, timeout=5).read()  # noqa: E731
        wait_until(lambda: json.loads(get("snapshot.json")) == taken[1] or None, 10, "the latest snapshot")
        assert json.loads(get("history.json")) == {
            "a": [dict(epoch=1, loss=3.0, group_size=2, bytes_per_round=1000),
                  dict(epoch=2, loss=2.5, group_size=2, bytes_per_round=2000, eval_loss=2.7)],
            "b": [dict(epoch=1, loss=3.05, group_size=2, bytes_per_round=1000)]}
        page = get("")
        # everything inline: nothing loaded from elsewhere, so it works offline
        assert b"snapshot.json" in page and not re.search(rb"(src|href)\s*=|@import|fetch\(\s*[\"']https?:", page)
        with pytest.raises(urllib.error.HTTPError):
            get("nothing-here")
    finally:
        dashboard.stop()


def test_a_port_in_use_is_one_line():
    from dht.errors import UserError
    from peer.ops.dashboard import Dashboard

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=f"cannot serve the dashboard on 127.0.0.1:{port} .*; pick another port"):
            Dashboard(dict, port)


@pytest.mark.slow
def test_the_dashboard_lists_the_peers_follows_their_epochs_without_a_reload_and_marks_a_killed_one_stale(
        tmp_path):
    driver = browser()
    swarm = Swarm(tmp_path)
    try:
        port = free_port()
        peers = [swarm.peer(f"p{i}", "--inner-steps", "10", *(("--dashboard", str(port)) if i == 0 else ()))
                 for i in range(3)]
        for peer in peers:
            peer.wait_rounds(1, timeout=180)
        ids = {peer.metrics[0]["peer_id"]: peer for peer in peers}
        observer = swarm.track(Proc([sys.executable, "-m", "peer", "status", "--initial-peers", swarm.maddr,
                                     "--serve", "0"], tmp_path, "observer"))
        url = wait_until(lambda: (re.findall(r"at (http://\S+/)", observer.stdout) or [None])[0], 60,
                         "the observer's dashboard address")
        driver.get(url)
        first = wait_until(lambda: (lambda shown: shown if set(shown) == set(ids) else None)(rows(driver)), 60,
                           "the page to list the three peers")
        assert all(health == "live" for _, health, _ in first.values()), first
        # no reload: the page's own polling shows every peer's epoch advance
        wait_until(lambda: all(rows(driver)[peer][0] > first[peer][0] for peer in ids), 120,
                   "every peer's epoch to advance on the page")
        # the running peer's own dashboard serves the same snapshot, from its own DHT node
        served = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/snapshot.json", timeout=10))
        assert {row["peer_id"] for row in served["peers"]} == set(ids) and served["run_id"] == "diloco"
        assert f"http://127.0.0.1:{port}/" in peers[0].stderr
        killed = peers[2].metrics[0]["peer_id"]
        signal_group(peers[2], signal.SIGKILL)
        wait_until(lambda: rows(driver).get(killed, (0, "", ""))[1] == "stale", 60, "the killed peer to turn stale")
        shown = rows(driver)
        assert shown[killed][2] == "stale" and all(health == "live" for peer, (_, health, _) in shown.items()
                                                   if peer != killed), shown
        assert driver.find_elements("css selector", "#chart-loss polyline"), "the loss chart drew no line"
        driver.save_screenshot(str(tmp_path / "dashboard.png"))
        if SCREENSHOT:
            shutil.copy(tmp_path / "dashboard.png", ROOT / SCREENSHOT)
    finally:
        driver.quit()
        swarm.close()
