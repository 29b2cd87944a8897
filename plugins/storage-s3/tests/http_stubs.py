"""Real local HTTP endpoints for the S3 fault tests: a relay in front of SeaweedFS, a throttling server.

:class:`Relay` forwards every TCP byte to a real server and records the head of each request (method,
path, headers), optionally holding back the requests a predicate picks for a while (a slow part upload).
:class:`ThrottlingServer` answers the requests it is told to with ``503 SlowDown`` and a ``Retry-After``,
the others with 200, and records each request's method, path and arrival time.
"""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Callable


class Relay:
    """A TCP relay on 127.0.0.1 in front of ``target_port``; :attr:`heads` holds each request's head as text.

    ``hold(request_line)`` gives the seconds to hold a request back before it goes on; ``drop(request_line)``
    says to cut the connection instead (the client sees it closed before any answer).
    """

    def __init__(self, target_port: int, hold: Callable[[str], float] | None = None,
                 drop: Callable[[str], bool] | None = None) -> None:  # fmt: skip
        self.target_port = target_port
        self.hold = hold
        self.drop = drop
        self.heads: list[str] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        try:
            while chunk := src.recv(1 << 20):
                if requests and chunk[:8].split(b" ", 1)[0] in (b"GET", b"PUT", b"POST", b"HEAD", b"DELETE"):
                    head = chunk.split(b"\r\n\r\n", 1)[0].decode("latin-1")
                    with self._lock:
                        self.heads.append(head)
                    line = head.split("\r\n", 1)[0]
                    if self.drop is not None and self.drop(line):
                        return
                    delay = self.hold(line) if self.hold else 0.0
                    if delay:
                        time.sleep(delay)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()


_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")  # fmt: skip


class ThrottlingServer:
    """An HTTP server on 127.0.0.1 that throttles: ``throttle(n, method)`` says whether the n-th request gets 503.

    :attr:`log` holds ``(method, path, monotonic time)`` of every request it received.
    """

    def __init__(self, throttle: Callable[[int, str], bool], retry_after: str | None = "1") -> None:
        self.log: list[tuple[str, str, float]] = []
        lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                with lock:
                    throttled = throttle(len(outer.log), self.command)
                    outer.log.append((self.command, self.path, time.monotonic()))
                if throttled:
                    body = b"" if self.command == "HEAD" else _SLOWDOWN
                    self.send_response(503, "Slow Down")
                    if retry_after is not None:
                        self.send_header("Retry-After", retry_after)
                    self.send_header("Content-Type", "application/xml")
                else:
                    body = b""
                    self.send_response(200)
                    self.send_header("ETag", '"0"')
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _answer

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class CredentialsEndpoint:
    """A container credentials endpoint (ECS/EKS) on 127.0.0.1: each GET issues new temporary credentials.

    The key id and secret stay ``key_id``/``secret``; the session token is ``<prefix>-1``, ``-2``, ... in
    :attr:`issued`, each valid ``valid_s`` seconds (AWS's SDKs refresh one that expires within minutes).
    """

    def __init__(self, key_id: str, secret: str, *, prefix: str = "container-token", valid_s: float = 300) -> None:
        import datetime
        import json

        self.issued: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer.issued.append(f"{prefix}-{len(outer.issued) + 1}")
                expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=valid_s)
                body = json.dumps({"AccessKeyId": key_id, "SecretAccessKey": secret, "Token": outer.issued[-1],
                                   "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}).encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v2/credentials/hicache"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class InstanceMetadata:
    """An EC2 instance metadata service (IMDSv2) and an STS endpoint on 127.0.0.1, for the chain's last links.

    ``PUT /latest/api/token`` gives a session token; ``GET /latest/meta-data/iam/security-credentials/``
    names the role, then that path plus the role hands out temporary credentials (only with the token).
    ``POST /`` with ``Action=AssumeRoleWithWebIdentity`` answers as STS does, recording the web identity
    token it was sent in :attr:`web_tokens`. Each hand-out's session token is in :attr:`issued`.
    """

    ROLE = "hicache-test-role"

    def __init__(self, key_id: str, secret: str) -> None:
        import datetime
        import json
        import urllib.parse

        self.issued: list[str] = []
        self.web_tokens: list[str] = []
        outer = self

        def expiry() -> datetime.datetime:
            return datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, status: int, body: bytes, kind: str = "text/plain") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:  # noqa: N802 - http.server's name
                ok = self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
                self._send(200, b"imds-session") if ok else self._send(404, b"")

            def do_GET(self) -> None:  # noqa: N802
                base = "/latest/meta-data/iam/security-credentials/"
                if self.headers.get("X-aws-ec2-metadata-token") != "imds-session":
                    return self._send(401, b"")
                if self.path == base:
                    return self._send(200, outer.ROLE.encode())
                if self.path == base + outer.ROLE:
                    outer.issued.append(f"instance-token-{len(outer.issued) + 1}")
                    body = {"Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": key_id, "SecretAccessKey": secret,
                            "Token": outer.issued[-1], "Expiration": expiry().strftime("%Y-%m-%dT%H:%M:%SZ"),
                            "LastUpdated": "2026-01-01T00:00:00Z"}  # fmt: skip
                    return self._send(200, json.dumps(body).encode(), "application/json")
                return self._send(404, b"")

            def do_POST(self) -> None:  # noqa: N802
                form = urllib.parse.parse_qs(self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode())
                if form.get("Action") != ["AssumeRoleWithWebIdentity"]:
                    return self._send(400, b"")
                outer.web_tokens.append(form["WebIdentityToken"][0])
                outer.issued.append(f"web-token-{len(outer.issued) + 1}")
                body = (
                    '<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
                    "<AssumeRoleWithWebIdentityResult><Credentials>"
                    f"<AccessKeyId>{key_id}</AccessKeyId><SecretAccessKey>{secret}</SecretAccessKey>"
                    f"<SessionToken>{outer.issued[-1]}</SessionToken>"
                    f"<Expiration>{expiry().strftime('%Y-%m-%dT%H:%M:%SZ')}</Expiration>"
                    "</Credentials></AssumeRoleWithWebIdentityResult></AssumeRoleWithWebIdentityResponse>"
                )
                return self._send(200, body.encode(), "text/xml")

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
