"""The :class:`Fetcher`: GET with redirects, retries and backoff, POST for webhooks, many URLs at once."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import random
import ssl
import time
import typing
from collections.abc import Iterable

import httpcore
import httpx

from workers.errors import ImageRejected, Reason

from .rules import (
    DEFAULT_PORTS,
    DRAIN_BYTES,
    KEEPALIVE_CONNECTIONS,
    KEEPALIVE_EXPIRY_S,
    POST_ANSWER_BYTES,
    REDIRECT_STATUSES,
    RETRY_STATUSES,
    Fetched,
    FetchPolicy,
    Posted,
    parse_url,
    retry_after_s,
)
from .transport import HOST_SLOTS, CheckedBackend, Deadline, RefusedAddress

#: One logger for the package (operators filter on ``workers.fetch``); refusals log the resolved address here.
log = logging.getLogger("workers.fetch")


def _origin_key(url: httpx.URL) -> tuple[str, str, int]:
    return url.scheme, url.raw_host.decode("ascii"), url.port or DEFAULT_PORTS[url.scheme]


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _ssl_failure(error: BaseException) -> ssl.SSLError | None:
    """The TLS error behind an httpcore error, if any (httpcore wraps it; its pool drops ``__cause__``
    but keeps ``__context__``)."""
    seen = 0
    cause: BaseException | None = error
    while cause is not None and seen < 8:
        if isinstance(cause, ssl.SSLError):
            return cause
        cause = cause.__cause__ or cause.__context__
        seen += 1
    return None


def _surplus_bytes(response: httpcore.Response) -> int:
    """Bytes the server sent after the end of the body, already read into the HTTP/1.1 parser.

    They would be parsed as the next answer on this keep-alive connection, so the caller drops the
    connection. httpcore exposes no public view of its h11 parser: the attributes are looked up
    defensively; where they are missing the surplus goes unseen (and the next request on that
    connection fails as a protocol error, which is retried).
    """
    stream = getattr(response.stream, "_stream", None)
    state = getattr(getattr(stream, "_connection", None), "_h11_state", None)
    trailing = getattr(state, "trailing_data", None)
    return len(trailing[0]) if trailing else 0


class _Transient(Exception):
    """A failure worth another attempt: a timeout, a connection error, or a 429/5xx answer."""

    def __init__(self, reason: Reason, detail: str, retry_after: float | None = None) -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail
        self.retry_after = retry_after


@dataclasses.dataclass(frozen=True)
class _Answer:
    status: int
    data: bytes = b""
    content_type: str = ""
    location: str | None = None


class Fetcher:
    """Fetches image URLs under a :class:`FetchPolicy`; thread-safe; pooled keep-alive connections.

    Args:
        policy: the limits; default :class:`FetchPolicy()`.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, policy: FetchPolicy | None = None) -> None:
        self.policy = policy or FetchPolicy()
        self._deadline = Deadline()
        if self.policy.ca_file is None:
            context = httpcore.default_ssl_context()  # certifi's bundle, as httpx
        else:
            context = ssl.create_default_context(cafile=self.policy.ca_file)
        self._pool = httpcore.ConnectionPool(
            ssl_context=context,
            max_connections=None,  # bounded by HOST_SLOTS: per_host per origin
            max_keepalive_connections=KEEPALIVE_CONNECTIONS,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
            network_backend=CheckedBackend(self.policy.allow_networks, self._deadline),
        )

    def __enter__(self) -> typing.Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every pooled connection."""
        self._pool.close()

    def fetch_many(self, urls: Iterable[str], *, threads: int = 16) -> list[Fetched | ImageRejected]:
        """Fetch every URL on ``threads`` threads.

        Returns:
            one entry per URL, in input order: its :class:`Fetched`, or the :class:`ImageRejected`
            that refused it (a bad URL never affects the others).
        """
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        urls = list(urls)
        if not urls:
            return []
        with concurrent.futures.ThreadPoolExecutor(min(threads, len(urls)), thread_name_prefix="fetch") as pool:
            return list(pool.map(self._fetch_or_rejection, urls))

    def _fetch_or_rejection(self, url: str) -> Fetched | ImageRejected:
        try:
            return self.fetch(url)
        except ImageRejected as e:
            return e

    def fetch(self, url: str) -> Fetched:
        """Fetch one URL: redirects followed, retries spent, every limit of the policy applied.

        Returns:
            its :class:`Fetched`.

        Raises:
            ImageRejected: ``fetch_invalid_url``, ``fetch_refused_address``, ``fetch_tls``,
                ``fetch_timeout``, ``fetch_connect``, ``fetch_status``, ``fetch_too_large`` or
                ``fetch_redirects``, with a detail naming the host, status or limit (an address
                only when the URL itself holds it, never one that a name resolved to).
        """
        policy = self.policy
        start = time.monotonic()
        deadline = start + policy.total_timeout_s
        target = parse_url(url)
        attempts, redirects = 1, 0
        while True:
            try:
                answer = self._exchange(target, deadline)
            except _Transient as e:
                failure = e
            else:
                if answer.location is None:
                    return Fetched(url=url, final_url=str(target), data=answer.data, status=answer.status,
                                   content_type=answer.content_type, attempts=attempts,
                                   elapsed_s=time.monotonic() - start, redirects=redirects)
                redirects += 1
                if redirects > policy.max_redirects:
                    raise ImageRejected(Reason.FETCH_REDIRECTS,
                                        f"more than {policy.max_redirects} redirects (last from {target})")
                try:
                    joined = target.join(answer.location)
                except (httpx.InvalidURL, TypeError, UnicodeError, ValueError) as e:
                    raise ImageRejected(Reason.FETCH_REDIRECTS,
                                        f"HTTP {answer.status} from {target} to {answer.location!r}: {e}") from e
                target = parse_url(joined, hop=f"redirect {redirects} from {target} to ")
                continue
            if failure.retry_after is not None and failure.retry_after > policy.retry_after_max_s:
                raise ImageRejected(Reason.FETCH_STATUS, f"{failure.detail} with Retry-After "
                                    f"{failure.retry_after:.0f} s, above the {policy.retry_after_max_s:g} s waited")
            tried = f" (after {attempts} attempts)" if attempts > 1 else ""
            if attempts > policy.retries or time.monotonic() >= deadline:
                raise ImageRejected(failure.reason, failure.detail + tried)
            ceiling = min(policy.backoff_max_s, policy.backoff_base_s * 2 ** min(attempts - 1, 32))
            backoff = random.uniform(0.0, ceiling)  # full jitter
            wait = max(failure.retry_after or 0.0, backoff)
            if time.monotonic() + wait >= deadline:
                raise ImageRejected(failure.reason, f"{failure.detail}{tried}; another attempt would pass the "
                                    f"total time limit of {policy.total_timeout_s:g} s")
            time.sleep(wait)
            attempts += 1

    def _exchange(self, url: httpx.URL, deadline: float) -> _Answer:
        """One request and its answer: a 2xx body, a redirect's Location, or a raised failure.

        Raises:
            ImageRejected: a failure that no retry mends.
            _Transient: a failure worth another attempt.
        """
        policy = self.policy
        request = httpcore.Request(
            b"GET",
            httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path),
            headers=[(b"Host", url.netloc), (b"User-Agent", policy.user_agent.encode()),
                     (b"Accept", b"image/*, */*;q=0.5"), (b"Accept-Encoding", b"identity")],
            extensions={"timeout": self._timeouts()},
        )
        return self._send(request, url, deadline, self._answer)

    def _timeouts(self) -> dict[str, float]:
        policy = self.policy
        return {"connect": policy.connect_timeout_s, "read": policy.read_timeout_s, "write": policy.read_timeout_s,
                "pool": policy.total_timeout_s}

    def _send(self, request: httpcore.Request, url: httpx.URL, deadline: float,
              answer: typing.Callable[[httpcore.Response, httpx.URL], _Answer]) -> _Answer:
        """Send ``request`` to ``url``'s host under the per-host bound and the deadline; ``answer``
        reads the response. Failures are mapped to reason codes.

        Raises:
            ImageRejected: a failure that no retry mends.
            _Transient: a failure worth another attempt.
        """
        policy = self.policy
        key = _origin_key(url)
        host = f"{key[1]}:{key[2]}"
        try:
            with HOST_SLOTS.hold(key, policy.per_host, deadline):
                self._deadline.at = deadline
                try:
                    response = self._pool.handle_request(request)
                    try:
                        return answer(response, url)
                    finally:
                        if _surplus_bytes(response):
                            response.extensions["network_stream"].close()
                        response.close()
                finally:
                    self._deadline.at = None
        except RefusedAddress as e:
            # the server's log has the address the name resolved to; the refusal has the URL and the rule
            log.info("refused %s: %s resolves to %s (%s)", url, e.host, e.address, e.why)
            raise ImageRejected(Reason.FETCH_REFUSED_ADDRESS, f"{url}: {e}") from None
        except (TimeoutError, httpcore.TimeoutException) as e:
            if time.monotonic() >= deadline:
                detail = f"{host}: the total time limit of {policy.total_timeout_s:g} s passed"
            elif isinstance(e, httpcore.ConnectTimeout):
                detail = f"{host}: no connection within {policy.connect_timeout_s:g} s"
            elif isinstance(e, TimeoutError):
                detail = str(e)
            else:
                detail = f"{host}: no data for {policy.read_timeout_s:g} s"
            raise _Transient(Reason.FETCH_TIMEOUT, detail) from None
        except (httpcore.NetworkError, httpcore.RemoteProtocolError) as e:
            tls = _ssl_failure(e)
            if tls is not None:
                message = getattr(tls, "verify_message", None) or tls  # "self-signed certificate", ...
                raise ImageRejected(Reason.FETCH_TLS, f"{host}: {message}") from None
            raise _Transient(Reason.FETCH_CONNECT, f"{host}: {e or type(e).__name__}") from None
        except httpcore.LocalProtocolError as e:
            raise ImageRejected(Reason.FETCH_INVALID_URL, f"{url}: {e}") from None

    def post(self, url: str, body: bytes, headers: Iterable[tuple[str, str]] = ()) -> Posted:
        """POST ``body`` to ``url`` once (webhooks): the same URL and address rules, per-host bound
        and time limits as :meth:`fetch`, but no redirect is followed and nothing is retried (the
        caller has its own schedule). A 3xx is an answer like any other non-2xx.

        Args:
            url: absolute http or https URL.
            body: the request body (sent with ``Content-Length``).
            headers: extra headers, e.g. ``[("Content-Type", "application/json")]``.

        Returns:
            a :class:`Posted` with the answer's status and its first :data:`POST_ANSWER_BYTES` bytes.

        Raises:
            ImageRejected: ``fetch_invalid_url``, ``fetch_refused_address``, ``fetch_tls``,
                ``fetch_timeout`` (``total_timeout_s`` passed), ``fetch_connect``.
        """
        start = time.monotonic()
        target = parse_url(url)
        request = httpcore.Request(
            b"POST",
            httpcore.URL(scheme=target.raw_scheme, host=target.raw_host, port=target.port, target=target.raw_path),
            headers=[(b"Host", target.netloc), (b"User-Agent", self.policy.user_agent.encode()),
                     (b"Accept-Encoding", b"identity"), (b"Content-Length", str(len(body)).encode()),
                     *((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers)],
            content=body,
            extensions={"timeout": self._timeouts()},
        )
        try:
            answer = self._send(request, target, start + self.policy.total_timeout_s, self._short_answer)
        except _Transient as e:
            raise ImageRejected(e.reason, e.detail) from None
        return Posted(url=url, status=answer.status, data=answer.data, elapsed_s=time.monotonic() - start)

    @staticmethod
    def _short_answer(response: httpcore.Response, url: httpx.URL) -> _Answer:
        """Any answer's status and its first :data:`POST_ANSWER_BYTES` body bytes (the rest drained
        up to :data:`DRAIN_BYTES`, else the connection is dropped)."""
        head, read = b"", 0
        for chunk in response.iter_stream():
            if len(head) < POST_ANSWER_BYTES:
                head += chunk[: POST_ANSWER_BYTES - len(head)]
            read += len(chunk)
            if read > DRAIN_BYTES:
                break  # closing the unfinished response closes its connection
        return _Answer(response.status, head)

    def _answer(self, response: httpcore.Response, url: httpx.URL) -> _Answer:
        """Read one answer under the size cap; 2xx → body, 3xx → Location, 429/5xx → _Transient."""
        status, headers = response.status, response.headers
        if 200 <= status < 300:
            cap = self.policy.max_bytes
            length = _header(headers, b"content-length")
            if length is not None and length.strip().isdigit() and int(length) > cap:
                raise ImageRejected(Reason.FETCH_TOO_LARGE,
                                    f"{url}: Content-Length {int(length)} bytes is above the cap of {cap} bytes")
            chunks, size = [], 0
            for chunk in response.iter_stream():
                size += len(chunk)
                if size > cap:
                    raise ImageRejected(Reason.FETCH_TOO_LARGE,
                                        f"{url}: the body passed the cap of {cap} bytes while streaming")
                chunks.append(chunk)
            surplus = _surplus_bytes(response)
            if surplus:
                raise ImageRejected(Reason.FETCH_TOO_LARGE, f"{url}: the body is longer than its Content-Length "
                                    f"of {length} bytes ({surplus}+ more bytes sent)")
            return _Answer(status, b"".join(chunks), _header(headers, b"content-type") or "")
        self._drain(response)
        if status in REDIRECT_STATUSES:
            location = _header(headers, b"location")
            if not location or not location.strip():
                raise ImageRejected(Reason.FETCH_REDIRECTS, f"HTTP {status} from {url} without a Location")
            return _Answer(status, location=location.strip())
        reason = response.extensions.get("reason_phrase", b"").decode("latin-1", "replace")
        detail = f"HTTP {status} {reason}".rstrip() + f" from {url}"
        if status in RETRY_STATUSES:
            raise _Transient(Reason.FETCH_STATUS, detail, retry_after_s(_header(headers, b"retry-after")))
        raise ImageRejected(Reason.FETCH_STATUS, detail)

    @staticmethod
    def _drain(response: httpcore.Response) -> None:
        """Read a short unwanted body to the end so its connection can be reused."""
        read = 0
        for chunk in response.iter_stream():
            read += len(chunk)
            if read > DRAIN_BYTES:
                return  # closing the unfinished response closes its connection
