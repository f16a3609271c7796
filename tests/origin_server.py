"""A real HTTP origin for the URL fetcher's tests and benchmark (``workers/fetch.py``).

The standard library's ``ThreadingHTTPServer`` (a thread per connection, HTTP/1.1 keep-alive) on
127.0.0.1, on a free port, in a background thread; ``tls=True`` serves https with a self-signed
certificate made at start (``cryptography``). It records every request (path, connection, start and
end times on the server's own clock, bytes sent, whether the body was sent whole) and the most
requests it ever had in flight, so tests assert on what the server saw.

Routes (``GET``; unknown paths answer 404):

``/photo/<name>``           a file of ``../shared/data/images/photos/``
``/img/<n>.jpg``            a small JPEG with ``n`` appended after its end-of-image marker: its own
                            sha256 per ``n``, still decodes; ``?delay=s`` waits before answering
``/status/<code>``          that status (``?retry_after=v`` adds a ``Retry-After`` header)
``/flaky/<key>``            500 the first time for ``key``, 200 after
``/ratelimit/<key>``        429 with ``Retry-After: 1`` (``?after=v``) the first time, 200 after
``/slow``                   a byte every second (``?interval=s``, ``?bytes=n``, default 10)
``/lying-length``           ``Content-Length`` half the body sent (surplus after the body)
``/short-length``           ``Content-Length`` twice the body sent, then the connection closes
``/big?bytes=n``            ``n`` bytes, chunked (``&length=1``: with its ``Content-Length``)
``/redirect/<n>``           a chain of ``n`` redirects ending at :attr:`OriginServer.photo`
``/redirect-to?url=u``      a 302 to ``u`` (any URL); without ``url``: a 302 without ``Location``

Run alone (``python -m tests.origin_server [--tls]``) it prints its base URL and serves until killed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import ipaddress
import os
import re
import shutil
import socket
import ssl
import sys
import tempfile
import threading
import time
import typing
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

ROOT = Path(__file__).resolve().parent.parent
#: The real photos: ``$SHARED_DIR/data/images/photos``, else ``../shared`` beside the checkout
#: (the rule of ``tests/conftest.py``, repeated so a benchmark can import this without pytest).
PHOTOS = Path(os.environ.get("SHARED_DIR") or ROOT / ".." / "shared").resolve() / "data" / "images" / "photos"
#: Bytes per write of ``/big``: the size of a typical socket send.
BIG_CHUNK = 64 * 1024


def small_jpeg() -> bytes:
    """A 16×16 grey baseline JPEG (a few hundred bytes) made by Pillow."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 130, 140)).save(out, format="JPEG", quality=90)
    return out.getvalue()


@dataclasses.dataclass
class Seen:
    """One request as the server saw it; times are the server's ``time.monotonic()`` (s)."""

    path: str
    target: str
    connection: int
    started: float
    finished: float | None = None
    status: int | None = None
    bytes_sent: int = 0
    completed: bool = False


def pixels_jpeg(n: int) -> bytes:
    """A 64×64 JPEG of smooth noise seeded by ``n``: images whose embeddings differ (``/img/<n>``
    share their pixels, so their vectors are one)."""
    import cv2
    import numpy as np

    rng = np.random.default_rng(n)
    img = cv2.resize(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), (64, 64), interpolation=cv2.INTER_CUBIC)
    return cv2.imencode(".jpg", img)[1].tobytes()


def self_signed(names: tuple[str, ...], folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for ``names`` (DNS names or IP addresses) and its P-256 key.

    Returns:
        ``(cert.pem, key.pem)`` in ``folder``.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    alt = []
    for name in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    timeout = 60  # an idle keep-alive connection's thread ends after this (s)
    server: _Server

    def setup(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(10)
            self.request.do_handshake()  # here, in the connection's thread, not in accept()
        super().setup()
        self.connection_id = self.server.origin._opened(self.request)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        self.server.origin._closed(self.request)

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        split = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        seen = self.server.origin._begin(split.path, self.path, self.connection_id)
        try:
            self._route(split.path, query, seen)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, TimeoutError):
            self.close_connection = True  # the client went away: the body was not sent whole
        finally:
            self.server.origin._end(seen)

    def _route(self, path: str, query: dict[str, str], seen: Seen) -> None:
        origin = self.server.origin
        if m := re.fullmatch(r"/img/(\d+)\.jpg", path):
            if "delay" in query:
                time.sleep(float(query["delay"]))
            return self._send(seen, 200, origin.jpeg + m.group(1).encode(), "image/jpeg")
        if m := re.fullmatch(r"/pixels/(\d+)\.jpg", path):  # distinct pixels per n, not only distinct bytes
            return self._send(seen, 200, pixels_jpeg(int(m.group(1))), "image/jpeg")
        if m := re.fullmatch(r"/photo/([^/]+)", path):
            data = origin.photo_bytes(m.group(1))
            if data is None:
                return self._send(seen, 404, b"no such photo\n")
            return self._send(seen, 200, data, "image/jpeg")
        if m := re.fullmatch(r"/status/(\d{3})", path):
            extra = [("Retry-After", query["retry_after"])] if "retry_after" in query else []
            return self._send(seen, int(m.group(1)), b"status\n", headers=extra)
        if m := re.fullmatch(r"/flaky/([^/]+)", path):
            if origin._first(path):
                return self._send(seen, 500, b"flaky\n")
            return self._send(seen, 200, origin.jpeg + m.group(1).encode(), "image/jpeg")
        if re.fullmatch(r"/ratelimit/([^/]+)", path):
            if origin._first(path):
                return self._send(seen, 429, b"slow down\n", headers=[("Retry-After", query.get("after", "1"))])
            return self._send(seen, 200, origin.jpeg, "image/jpeg")
        if path == "/slow":
            return self._slow(seen, int(query.get("bytes", 10)), float(query.get("interval", 1.0)))
        if path == "/lying-length":
            body = origin.jpeg * 2
            return self._send(seen, 200, body, "image/jpeg", length=len(body) // 2)
        if path == "/short-length":
            self.close_connection = True
            return self._send(seen, 200, origin.jpeg, "image/jpeg", length=2 * len(origin.jpeg))
        if path == "/big":
            return self._big(seen, int(query.get("bytes", 1 << 20)), query.get("length") == "1")
        if m := re.fullmatch(r"/redirect/(\d+)", path):
            n = int(m.group(1))
            to = f"/redirect/{n - 1}" if n > 1 else f"/photo/{origin.photo}"
            return self._send(seen, 302, b"", headers=[("Location", to)])
        if path == "/redirect-to":
            headers = [("Location", query["url"])] if "url" in query else []
            return self._send(seen, int(query.get("status", 302)), b"", headers=headers)
        return self._send(seen, 404, b"not found\n")

    def _head(self, status: int, headers: list[tuple[str, str]]) -> bytes:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Status"
        lines = [f"HTTP/1.1 {status} {phrase}"] + [f"{k}: {v}" for k, v in headers]
        if self.close_connection:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _send(self, seen: Seen, status: int, body: bytes, content_type: str = "text/plain",
              headers: list[tuple[str, str]] = (), length: int | None = None) -> None:
        """Status, headers and body in one write (no Nagle/delayed-ACK stall between them)."""
        seen.status = status
        head = self._head(status, [("Content-Type", content_type),
                                   ("Content-Length", str(len(body) if length is None else length)), *headers])
        # Out of flight before the write: once the bytes are out, the client may read them, free its
        # slot and start its next request before this thread runs again, so ending after the write
        # would count one request too many for an instant.
        self.server.origin._end(seen)
        self.wfile.write(head + body)
        seen.bytes_sent = len(body)
        seen.completed = True

    def _slow(self, seen: Seen, size: int, interval: float) -> None:
        seen.status = 200
        self.wfile.write(self._head(200, [("Content-Type", "application/octet-stream"),
                                          ("Content-Length", str(size))]))
        for _ in range(size):
            time.sleep(interval)
            self.wfile.write(b"x")
            seen.bytes_sent += 1
        seen.completed = True

    def _big(self, seen: Seen, size: int, with_length: bool) -> None:
        seen.status = 200
        framing = ("Content-Length", str(size)) if with_length else ("Transfer-Encoding", "chunked")
        self.wfile.write(self._head(200, [("Content-Type", "application/octet-stream"), framing]))
        chunk = b"\xab" * BIG_CHUNK
        while seen.bytes_sent < size:
            part = chunk[: size - seen.bytes_sent]
            self.wfile.write(part if with_length else b"%x\r\n%b\r\n" % (len(part), part))
            seen.bytes_sent += len(part)
        if not with_length:
            self.wfile.write(b"0\r\n\r\n")
        seen.completed = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, origin: OriginServer, context: ssl.SSLContext | None) -> None:
        self.origin = origin
        self.context = context
        super().__init__(("127.0.0.1", 0), _Handler)

    def get_request(self) -> tuple[socket.socket, object]:
        sock, address = self.socket.accept()
        if self.context is not None:
            sock = self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address

    def handle_error(self, request: object, client_address: object) -> None:
        self.origin.errors += 1  # a failed TLS handshake, a client gone mid-request: counted, not printed


class OriginServer:
    """The origin, started on 127.0.0.1 on a free port (``with OriginServer() as server:``).

    Args:
        tls: serve https with a self-signed certificate (:attr:`cert_path` to trust it).
        tls_names: the names the certificate is for (DNS names or IP addresses).
        photos: the folder ``/photo/<name>`` serves.

    Attributes:
        url: base URL, ``http://127.0.0.1:<port>`` (``https://`` with ``tls``).
        cert_path: the certificate's PEM file with ``tls``, else ``None``.
        jpeg: the small JPEG ``/img/<n>.jpg`` starts with.
        photo: the photo the ``/redirect/<n>`` chains end at (the first by name).
        errors: connections that ended in an error (failed TLS handshakes included).
    """

    def __init__(self, *, tls: bool = False, tls_names: tuple[str, ...] = ("127.0.0.1", "localhost"),
                 photos: Path = PHOTOS) -> None:
        self.photos = photos
        names = sorted(p.name for p in photos.glob("*.jpg")) if photos.is_dir() else []
        self.photo = names[0] if names else "missing.jpg"
        self.jpeg = small_jpeg()
        self.errors = 0
        self._lock = threading.Lock()
        self._photo_cache: dict[str, bytes] = {}
        self._folder = Path(tempfile.mkdtemp(prefix="origin-"))
        self.cert_path: Path | None = None
        context = None
        if tls:
            self.cert_path, key_path = self_signed(tls_names, self._folder)
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(self.cert_path, key_path)
        self._server = _Server(self, context)
        self.port = self._server.server_address[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._thread: threading.Thread | None = None
        self.reset()

    # lifecycle

    def start(self) -> OriginServer:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"origin-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and cut every open connection (their threads end)."""
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        shutil.rmtree(self._folder, ignore_errors=True)

    def __enter__(self) -> typing.Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # what the server saw

    def reset(self) -> None:
        """Forget the requests seen, the flaky/rate-limit keys and the peaks (connections stay open)."""
        with self._lock:
            self._seen: list[Seen] = []
            self._keys: set[str] = set()
            self._in_flight = 0
            self.max_in_flight = 0
            self.connections_opened = 0
            self._sockets: set[socket.socket] = getattr(self, "_sockets", set())
            self._open = len(self._sockets)
            self.max_open = self._open

    def requests(self, path: str | None = None) -> list[Seen]:
        """Requests seen (for ``path`` only, query string excluded), in arrival order."""
        with self._lock:
            return [s for s in self._seen if path is None or s.path == path]

    def count(self, path: str | None = None) -> int:
        """Requests seen for ``path`` (all when ``None``)."""
        return len(self.requests(path))

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until no request is in flight (a handler still writing to a gone client has ended)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if self._in_flight == 0:
                    return True
            time.sleep(0.01)
        return False

    def photo_bytes(self, name: str) -> bytes | None:
        """The bytes of photo ``name``, cached; ``None`` when there is no such file."""
        with self._lock:
            if name in self._photo_cache:
                return self._photo_cache[name]
        path = self.photos / name
        if "/" in name or name.startswith(".") or not path.is_file():
            return None
        data = path.read_bytes()
        with self._lock:
            self._photo_cache[name] = data
        return data

    # bookkeeping, called by the handler threads

    def _opened(self, sock: socket.socket) -> int:
        with self._lock:
            self._sockets.add(sock)
            self.connections_opened += 1
            self._open += 1
            self.max_open = max(self.max_open, self._open)
            return self.connections_opened

    def _closed(self, sock: socket.socket) -> None:
        with self._lock:
            if sock in self._sockets:
                self._sockets.discard(sock)
                self._open -= 1

    def _begin(self, path: str, target: str, connection: int) -> Seen:
        seen = Seen(path=path, target=target, connection=connection, started=time.monotonic())
        with self._lock:
            self._seen.append(seen)
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
        return seen

    def _end(self, seen: Seen) -> None:
        """Out of flight, once per request (``_send`` ends it before its write, ``do_GET`` after)."""
        with self._lock:
            if seen.finished is not None:
                return
            seen.finished = time.monotonic()
            self._in_flight -= 1

    def _first(self, key: str) -> bool:
        """True the first time ``key`` is asked for (since the last :meth:`reset`)."""
        with self._lock:
            first = key not in self._keys
            self._keys.add(key)
            return first


def main(argv: list[str]) -> None:
    with OriginServer(tls="--tls" in argv) as server:
        print(server.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1:])
