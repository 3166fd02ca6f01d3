"""A fault-injecting HTTP proxy on loopback, in front of a real server, for the client tests.

Each request gets a number (0, 1, ...) in arrival order. Requests numbered below ``fail_first``, and
from ``fail_from`` on (a server that died mid-run; None: never), are answered with ``fail_status``
without reaching the server; those below ``slow_first`` are held for
``delay`` seconds first (longer than a client's read timeout: it gives up); the rest are forwarded as
they are (with their API key). ``seen`` counts requests, ``forwarded`` those that reached the server.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FaultProxy:
    def __init__(self, upstream: str, fail_first: int = 0, fail_status: int = 503, slow_first: int = 0,
                 delay: float = 0.0, fail_from: int | None = None):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.fail_first, self.fail_from, self.fail_status = fail_first, fail_from, fail_status
        self.slow_first, self.delay = slow_first, delay
        self.seen = self.forwarded = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                proxy.handle(self, None)

            def do_POST(self) -> None:
                proxy.handle(self, self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FaultProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handle(self, request: BaseHTTPRequestHandler, body: bytes | None) -> None:
        with self.lock:
            number, self.seen = self.seen, self.seen + 1
        if number < self.fail_first or (self.fail_from is not None and number >= self.fail_from):
            return self.reply(request, self.fail_status, json.dumps({"error": "injected"}).encode())
        if number < self.slow_first:
            time.sleep(self.delay)
        connection = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            key = {"Authorization": request.headers["Authorization"]} if "Authorization" in request.headers else {}
            connection.request(request.command, request.path, body=body,
                               headers={"Content-Type": "application/json", **key})
            response = connection.getresponse()
            status, data = response.status, response.read()
        finally:
            connection.close()
        with self.lock:
            self.forwarded += 1
        self.reply(request, status, data)

    @staticmethod
    def reply(request: BaseHTTPRequestHandler, status: int, data: bytes) -> None:
        try:
            request.send_response(status)
            request.send_header("Content-Type", "application/json")
            request.send_header("Content-Length", str(len(data)))
            request.end_headers()
            request.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a read timeout): nobody is left to answer
