"""The swarm in a browser: ``python -m peer status --serve PORT``, or ``--dashboard PORT`` on a running peer.

No server joins the run: whoever serves the page reads the swarm's records through its own DHT node, as
``python -m peer status`` does, and any peer or observer can serve its own view. The page is one HTML file with its
script and style inline (it works offline) that polls two JSON documents:

- ``/snapshot.json``: the same snapshot ``python -m peer status --json`` prints (``status.snapshot``);
- ``/history.json``: what this server has seen since it started, per peer and epoch (loss, eval loss, group size,
  bytes per round), since a record holds only its peer's latest numbers.

The plots are plain SVG drawn by the page's script: no library, nothing fetched from the internet.
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Dict

from dht.errors import UserError

logger = logging.getLogger(__name__)
PAGE = Path(__file__).with_name("dashboard.html")
REFRESH_SECONDS = 2.0
MAX_EPOCHS = 5000  # epochs of history kept per peer


class History:
    """Per peer, per epoch: the numbers its record showed at that epoch (the last we saw)."""

    def __init__(self):
        self.peers: Dict[str, Dict[int, Dict[str, Any]]] = {}
        self.lock = threading.Lock()

    def add(self, snapshot: Dict[str, Any]) -> None:
        with self.lock:
            for row in snapshot["peers"]:
                epochs = self.peers.setdefault(row["peer_id"], {})
                point = epochs.setdefault(row["epoch"], {})
                point.update(loss=row["loss"], group_size=row.get("group_size", 0),
                             bytes_per_round=row["bytes_per_round"])
                if row.get("eval_loss") is not None and row.get("eval_epoch", -1) >= 0:
                    epochs.setdefault(row["eval_epoch"], {})["eval_loss"] = row["eval_loss"]
                for old in sorted(epochs)[:-MAX_EPOCHS]:
                    del epochs[old]

    def to_json(self) -> Dict[str, Any]:
        with self.lock:
            return {peer: [dict(epoch=epoch, **point) for epoch, point in sorted(epochs.items())]
                    for peer, epochs in self.peers.items()}


class Dashboard:
    """Refreshes the snapshot in the background and serves the page and both documents on ``host:port``."""

    def __init__(self, take_snapshot: Callable[[], Dict[str, Any]], port: int, host: str = "127.0.0.1",
                 refresh: float = REFRESH_SECONDS):
        self.take_snapshot, self.refresh = take_snapshot, refresh
        self.history, self.latest = History(), None
        self.stopped = threading.Event()
        try:
            self.server = ThreadingHTTPServer((host, port), self._handler())
        except OSError as e:
            raise UserError(f"cannot serve the dashboard on {host}:{port} ({e.strerror or e}); pick another "
                            f"port") from None
        self.server.daemon_threads = True
        self.threads = [threading.Thread(target=self.server.serve_forever, name="dashboard", daemon=True),
                        threading.Thread(target=self._poll, name="dashboard-poll", daemon=True)]

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> "Dashboard":
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()

    def _poll(self) -> None:
        while not self.stopped.is_set():
            try:
                snapshot = self.take_snapshot()
                self.history.add(snapshot)
                self.latest = snapshot
            except Exception as e:  # a DHT that is slow to answer now; the page keeps the last snapshot
                logger.debug(f"dashboard snapshot failed: {e!r}")
            self.stopped.wait(self.refresh)

    def _handler(self):
        dashboard = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (the stdlib's name)
                path = self.path.split("?", 1)[0]
                if path == "/":
                    self._send(PAGE.read_bytes(), "text/html; charset=utf-8")
                elif path == "/snapshot.json":
                    self._send(json.dumps(dashboard.latest).encode(), "application/json")
                elif path == "/history.json":
                    self._send(json.dumps(dashboard.history.to_json()).encode(), "application/json")
                else:
                    self.send_error(HTTPStatus.NOT_FOUND)

            def _send(self, body: bytes, kind: str) -> None:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # no line per request on the peer's terminal
                pass

        return Handler
