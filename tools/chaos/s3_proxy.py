"""A fault-injecting HTTP proxy for an S3 endpoint (moto's server in tests): the failures real object stores have.

    proxy = S3FaultProxy("http://127.0.0.1:5000").start()   # checkpoint.remote.endpoint_url=proxy.url
    proxy.set_rule(FaultRule("slowdown", rank=None, fraction=1.0))
    proxy.clear()

Rules, matched against each request (``rank``: only keys of that rank's objects and markers, None: all):

    slowdown   503 SlowDown (throttling)
    error500   500 InternalError
    full       507 XMinioStorageFull on writes (a full MinIO; S3 itself never fills)
    reset      the connection is closed without an answer

``fraction`` is the share of matching requests that fail (seeded). Everything
else is forwarded unchanged. Test tooling, not part of MegaTier.
"""
from __future__ import annotations

import http.client
import random
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import urlparse

_ERRORS = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "error500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "full": (507, "XMinioStorageFull", "Storage backend has reached its minimum free drive threshold."),
}
KINDS = (*_ERRORS, "reset")
_RANK = re.compile(r"/rank(\d{5})\.")


@dataclass(frozen=True)
class FaultRule:
    kind: str
    rank: Optional[int] = None
    fraction: float = 1.0
    writes_only: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r}: use one of {', '.join(KINDS)}")


class S3FaultProxy:
    """Forwards to ``upstream`` on 127.0.0.1:<port>, failing requests that match the current rule."""

    def __init__(self, upstream: str, seed: int = 0):
        parsed = urlparse(upstream)
        self.upstream = (parsed.hostname, parsed.port)
        self.rule: Optional[FaultRule] = None
        self.failed = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "S3FaultProxy":
        threading.Thread(target=self._server.serve_forever, name="s3-fault-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def set_rule(self, rule: Optional[FaultRule]) -> None:
        with self._lock:
            self.rule = rule

    def clear(self) -> None:
        self.set_rule(None)

    def _fault_for(self, method: str, path: str) -> Optional[str]:
        with self._lock:
            rule = self.rule
            if rule is None or (rule.writes_only or rule.kind == "full") and method not in ("PUT", "POST"):
                return None
            if rule.rank is not None:
                m = _RANK.search(path)
                if m is None or int(m.group(1)) != rule.rank:
                    return None
            if self._rng.random() >= rule.fraction:
                return None
            self.failed += 1
            return rule.kind

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy._fault_for(self.command, self.path)
                if fault == "reset":
                    self.close_connection = True
                    self.connection.close()
                    return
                if fault is not None:
                    self._error(*_ERRORS[fault])
                    return
                self._forward(body)

            def _error(self, status: int, code: str, message: str) -> None:
                xml = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code><Message>{message}"
                       f"</Message></Error>").encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(xml)))
                self.end_headers()
                self.wfile.write(xml)

            def _forward(self, body: bytes) -> None:
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = dict(self.headers.items())  # the Host the client signed stays as it was
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        return Handler
