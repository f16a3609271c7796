"""Fetch stage: an image URL → its bytes (:class:`Fetched`), or :class:`ImageRejected` with a ``fetch_*`` code.

The bulk workers fetch URLs, never a web request: one URL may take up to ``total_timeout_s``. Every
failure is the one image's reason code; nothing here fails a chunk.

* **URLs** (``fetch_invalid_url``): http and https only, with a host name or IP literal, no
  userinfo, a port in 1..65535. Every redirect hop is checked by the same rules.
* **Addresses** (``fetch_refused_address``, server-side request forgery): the fetcher resolves every
  hop's host itself and checks every address (:func:`address_refusal`: loopback, private,
  link-local incl. the cloud metadata 169.254.169.254, multicast, reserved, unspecified, shared
  100.64/10, IPv4-mapped IPv6 of those) unless it lies in ``allow_networks``. A host with any
  refused address is refused. The socket then connects to the checked address itself, so the HTTP
  library never looks the name up again (DNS rebinding cannot slip past the check), while TLS still
  sends the host name (SNI) and verifies the certificate against it (``fetch_tls``). The refusal's
  detail names the URL (the hop refused), its host and the rule broken ("resolves to a private
  address"), never the address a host name resolved to: that is this server's view of its own DNS
  and hosts file, not the sender's to learn. The address is logged (INFO, this module's logger),
  on the server only.
* **Redirects** (``fetch_redirects``): followed by the fetcher, never by the library, at most
  ``max_redirects``; a redirect without a usable ``Location`` fails at once.
* **Size** (``fetch_too_large``): a ``Content-Length`` above ``max_bytes`` fails before the body is
  read; a body is counted while it streams and cut off at the cap; bytes after the body a
  ``Content-Length`` announced fail the image and drop the connection (they would otherwise be read
  as the next answer on it). A body shorter than its ``Content-Length`` is ``fetch_connect``.
* **Time** (``fetch_timeout``): ``connect_timeout_s`` per connection (TCP + TLS),
  ``read_timeout_s`` per socket read, and ``total_timeout_s`` over the whole fetch, redirects and
  retries included, enforced at every socket operation (a server dripping a byte a second is cut
  off). Name resolution uses the system resolver, whose own time limits apply.
* **Retries**: 429, 500, 502, 503, 504, timeouts and connection errors are tried again after
  ``max(Retry-After, backoff)``, the backoff exponential with full jitter, until ``1 + retries``
  attempts are spent or the next one would start after the total timeout. A Retry-After above
  ``retry_after_max_s`` is not waited: the image fails ``fetch_status`` at once. Other statuses
  fail at once (``fetch_status``, the detail has the code).
* **POST** (:meth:`Fetcher.post`, webhooks): the same URL, address, time and per-host rules, one
  attempt, no redirect followed (a 3xx is returned like any other status).
* **Concurrency**: at most ``per_host`` requests in flight per (scheme, host, port) across every
  thread and every :class:`Fetcher` of the process; connections are pooled and kept alive.

Built on httpcore (the transport under httpx) with our own network backend (the address check and
the deadline); httpx parses and normalises URLs (IDNA, percent-encoding).

No Django, Celery or torch here: this module is a plain library.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import email.utils
import ipaddress
import logging
import random
import re
import socket
import ssl
import threading
import time
import typing
from collections.abc import Iterable, Iterator

import httpcore
import httpx

from workers.errors import ImageRejected, Reason

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Statuses tried again with backoff: rate limited and the transient server errors (RFC 9110 §15.5.30, §15.6).
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
#: Statuses followed as redirects (RFC 9110 §15.4); the next hop is always a GET.
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
#: Carrier-grade NAT space (RFC 6598): neither private nor global in Python's tables, never a public origin.
SHARED_ADDRESS_SPACE = ipaddress.IPv4Network("100.64.0.0/10")
#: Body bytes of a redirect or an error answer read so its connection can be reused; a longer body
#: closes the connection instead (reading it would only cost time).
DRAIN_BYTES = 64 * 1024
#: Idle keep-alive connections a :class:`Fetcher` keeps, and for how long (s). httpx keeps 20 for
#: 5 s; a bulk fetcher returns to the same few hosts for minutes, with ``per_host`` (8) each.
KEEPALIVE_CONNECTIONS = 128
KEEPALIVE_EXPIRY_S = 30.0
#: Schemes a URL may have, with their default ports (RFC 9110 §4.2).
DEFAULT_PORTS = {"http": 80, "https": 443}
#: A host name after IDNA encoding: letters, digits, hyphens, underscores (seen in the wild), dots.
_HOST_NAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?")


@dataclasses.dataclass(frozen=True)
class FetchPolicy:
    """Limits of one :class:`Fetcher`.

    Attributes:
        connect_timeout_s: TCP connect plus TLS handshake, per connection (s).
        read_timeout_s: longest wait for any one socket read or write (s).
        total_timeout_s: the whole fetch, redirects, retries and their waits included (s).
        max_bytes: largest body accepted (bytes); the pipeline's ``max_image_bytes`` default, 50 MiB.
        max_redirects: redirects followed per fetch.
        retries: tries after the first for 429/5xx, timeouts and connection errors (attempts = 1 + retries).
        backoff_base_s: the first retry waits up to this (s); each next one up to twice the last
            ("full jitter": uniform in [0, min(backoff_max_s, base · 2^(n-1))]).
        backoff_max_s: cap of one backoff wait (s).
        retry_after_max_s: the longest ``Retry-After`` waited (s); a longer one fails ``fetch_status``.
        per_host: requests in flight per (scheme, host, port) in this process, every Fetcher together.
        allow_networks: networks fetched even though loopback/private/...: strings such as
            ``"127.0.0.1/32"`` or :mod:`ipaddress` networks, kept as networks. Empty in service.
        user_agent: the ``User-Agent`` header sent.
        ca_file: PEM file of the certificate authorities trusted for https instead of certifi's
            bundle (a private CA; the tests' self-signed origin). ``None``: certifi.

    Raises:
        ValueError: a field is out of range; the message names the field.
    """

    connect_timeout_s: float = 5.0
    read_timeout_s: float = 20.0
    total_timeout_s: float = 60.0
    max_bytes: int = 50 * 1024 * 1024
    max_redirects: int = 5
    retries: int = 3
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    retry_after_max_s: float = 60.0
    per_host: int = 8
    allow_networks: tuple[IPNetwork, ...] = ()
    user_agent: str = "clip-embeddings-fetcher/1.0"
    ca_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "read_timeout_s", "total_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("backoff_base_s", "backoff_max_s", "retry_after_max_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0):
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
        for name, low in (("max_bytes", 1), ("max_redirects", 0), ("retries", 0), ("per_host", 1)):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if isinstance(self.allow_networks, str | bytes):
            raise ValueError(  # noqa: TRY004 (every field's error is a ValueError naming it)
                f"allow_networks must be a sequence of networks, got {self.allow_networks!r}")
        try:
            networks = tuple(ipaddress.ip_network(n) for n in self.allow_networks)
        except (TypeError, ValueError) as e:
            raise ValueError(f"allow_networks: {e}") from e
        object.__setattr__(self, "allow_networks", networks)
        agent = self.user_agent
        if not isinstance(agent, str) or not agent or re.search(r"[\x00-\x1f\x7f]", agent):
            raise ValueError(f"user_agent must be a non-empty line of text, got {self.user_agent!r}")
        if self.ca_file is not None and not isinstance(self.ca_file, str):
            raise ValueError(f"ca_file must be a path or None, got {self.ca_file!r}")


@dataclasses.dataclass(frozen=True)
class Fetched:
    """One URL's body.

    Attributes:
        url: the URL as asked.
        final_url: the URL that answered, after redirects (normalised: IDNA host, percent-encoding).
        data: the body, at most ``max_bytes``.
        status: the final HTTP status (2xx).
        content_type: the ``Content-Type`` header, ``""`` when absent (the decoder sniffs anyway).
        attempts: 1 + the retries spent (a redirect is not a retry).
        elapsed_s: wall time of the whole fetch (s), waits included.
        redirects: redirects followed.
    """

    url: str
    final_url: str
    data: bytes = dataclasses.field(repr=False)
    status: int
    content_type: str
    attempts: int
    elapsed_s: float
    redirects: int


#: Body bytes of an answer to :meth:`Fetcher.post` kept (for the caller's record of the attempt).
POST_ANSWER_BYTES = 512


@dataclasses.dataclass(frozen=True)
class Posted:
    """The answer to one :meth:`Fetcher.post`.

    Attributes:
        url: the URL as asked.
        status: the HTTP status, whatever it is (a 3xx is not followed).
        data: the answer body's first :data:`POST_ANSWER_BYTES` bytes.
        elapsed_s: wall time of the request (s).
    """

    url: str
    status: int
    data: bytes = dataclasses.field(repr=False)
    elapsed_s: float


def address_refusal(address: IPAddress, allow_networks: Iterable[IPNetwork] = ()) -> str | None:
    """Why a resolved address may not be fetched, or ``None`` when it may.

    An IPv4-mapped IPv6 address (``::ffff:a.b.c.d``) is judged as its IPv4 address, a 6to4 one by
    the IPv4 address inside it.

    Args:
        address: one resolved address.
        allow_networks: networks allowed whatever they are (tests, a private origin on purpose).

    Returns:
        ``"unspecified"``, ``"loopback"``, ``"link-local"``, ``"multicast"``, ``"shared address
        space"``, ``"reserved"``, ``"private"``, ``"not global"`` or ``"6to4-wrapped <one of
        those>"``; ``None`` when allowed.
    """
    ip = address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip.version == net.version and ip in net for net in allow_networks):
        return None
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if ip.version == 4 and ip in SHARED_ADDRESS_SPACE:
        return "shared address space"
    if ip.is_reserved:
        return "reserved"
    if ip.is_private:
        return "private"
    if not ip.is_global:
        return "not global"
    if isinstance(ip, ipaddress.IPv6Address) and ip.sixtofour is not None:
        inner = address_refusal(ip.sixtofour, allow_networks)
        return None if inner is None else f"6to4-wrapped {inner}"
    return None


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait, ``None`` when absent or unreadable.

    Args:
        value: the header: delay-seconds or an HTTP-date (RFC 9110 §10.2.3).
        now: the current Unix time (s), for the HTTP-date form; default ``time.time()``.

    Returns:
        seconds >= 0 (a date in the past is 0).
    """
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # "-0000": RFC 5322's "UTC, no local zone known"
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class _HostSlots:
    """Requests in flight per (scheme, host, port), bounded across threads.

    Each caller passes its own limit and waits while the count of its key is at that limit, so
    fetchers with different ``per_host`` share one count per host. One condition for all keys:
    ``notify_all`` wakes every waiter to recheck its own key (a handful of threads per process).
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._busy: dict[tuple[str, str, int], int] = {}

    @contextlib.contextmanager
    def hold(self, key: tuple[str, str, int], limit: int, deadline: float) -> Iterator[None]:
        """Hold one of ``limit`` slots of ``key`` for the ``with`` body.

        Raises:
            TimeoutError: no slot came free before ``deadline`` (``time.monotonic()`` seconds).
        """
        with self._changed:
            while self._busy.get(key, 0) >= limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no free request slot for {key[1]}:{key[2]} ({limit} in flight)")
                self._changed.wait(left)
            self._busy[key] = self._busy.get(key, 0) + 1
        try:
            yield
        finally:
            with self._changed:
                left = self._busy[key] - 1
                if left:
                    self._busy[key] = left
                else:
                    del self._busy[key]  # a bulk job meets many hosts: keep only the busy ones
                self._changed.notify_all()

    def busy(self, key: tuple[str, str, int]) -> int:
        """Requests in flight for ``key`` now."""
        with self._changed:
            return self._busy.get(key, 0)


#: The one per-host bound of the process: ``per_host`` holds across every Fetcher and every thread
#: (a worker may build several fetchers, e.g. one per chunk).
HOST_SLOTS = _HostSlots()


class _Deadline(threading.local):
    """The current fetch's deadline (``time.monotonic()`` s) of the calling thread; httpcore's sync
    pool does all socket work on the thread that asked, so a thread-local reaches it."""

    at: float | None = None

    def clamp(self, timeout: float | None, error: type[Exception]) -> float | None:
        """``timeout`` shortened to what is left before the deadline; ``error`` when none is left."""
        if self.at is None:
            return timeout
        left = self.at - time.monotonic()
        if left <= 0:
            raise error("the total time limit passed")
        return left if timeout is None else min(timeout, left)


class _RefusedAddress(Exception):
    """A host resolved to an address :func:`address_refusal` refuses (raised before any connect).

    Its message names the host and the rule, never the address a host *name* resolved to: the
    message reaches whoever sent the URL (a row's failure, an API answer, a webhook delivery), and
    what a name resolves to on this server (its hosts file, its internal DNS) is not theirs to
    learn. The address is kept in ``address`` for the server's own log. A literal address in the
    URL is named: the sender wrote it.
    """

    def __init__(self, host: str, address: IPAddress, why: str) -> None:
        kind = f"{'an' if why[0] in 'aeiou' else 'a'} {why} address"
        # the setting that allows it, named where the refusal is read (the per-row failure, a delivery)
        allow = "refused unless FETCH_ALLOW_NETWORKS allows it"
        self.host, self.address, self.why = host, address, why
        if host.strip("[]") == str(address):
            super().__init__(f"{host} is {kind}, {allow}")
        else:
            super().__init__(f"{host} resolves to {kind}, {allow}")


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose every read, write and TLS handshake also stops at the fetch's deadline."""

    def __init__(self, stream: httpcore.NetworkStream, deadline: _Deadline) -> None:
        self._stream = stream
        self._deadline = deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, self._deadline.clamp(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, self._deadline.clamp(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        timeout = self._deadline.clamp(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, timeout), self._deadline)

    def get_extra_info(self, info: str) -> typing.Any:
        return self._stream.get_extra_info(info)


class _CheckedBackend(httpcore.NetworkBackend):
    """httpcore's network backend that resolves the host itself, refuses it when any address is
    refused, and connects to the checked address (no second lookup)."""

    def __init__(self, allow_networks: tuple[IPNetwork, ...], deadline: _Deadline) -> None:
        self._allow = allow_networks
        self._deadline = deadline
        self._sockets = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None) -> httpcore.NetworkStream:
        addresses = resolve(host, port)
        for address in addresses:
            why = address_refusal(address, self._allow)
            if why is not None:
                raise _RefusedAddress(host, address, why)
        error: Exception | None = None
        for address in addresses:  # in the resolver's order, as socket.create_connection does
            mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
            target = mapped or address
            try:
                stream = self._sockets.connect_tcp(
                    str(target), port, timeout=self._deadline.clamp(timeout, httpcore.ConnectTimeout),
                    local_address=local_address, socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                error = e
                continue
            return _DeadlineStream(stream, self._deadline)
        assert error is not None
        raise error

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("unix sockets are not fetched")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to for a TCP connection, in the resolver's order, deduplicated.

    Raises:
        httpcore.ConnectError: the name does not resolve.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError, ValueError) as e:
        raise httpcore.ConnectError(f"cannot resolve {host}: {e}") from e
    seen: dict[IPAddress, None] = {}
    for _family, _type, _proto, _name, sockaddr in infos:
        seen.setdefault(ipaddress.ip_address(sockaddr[0]), None)
    if not seen:
        raise httpcore.ConnectError(f"{host} resolves to no address")
    return list(seen)


def parse_url(url: str | httpx.URL, *, hop: str = "") -> httpx.URL:
    """A URL checked for fetching: normalised by httpx (IDNA host, percent-encoding, no fragment).

    Args:
        url: absolute http or https URL.
        hop: words that open the detail for a redirect's target (``"redirect 2 from <url> to "``).

    Raises:
        ImageRejected: ``fetch_invalid_url`` (other scheme, no host, userinfo, bad port or host).
    """
    if not isinstance(url, str | httpx.URL):
        raise ImageRejected(Reason.FETCH_INVALID_URL, f"{hop}{url!r} is not a URL string")
    try:
        parsed = url if isinstance(url, httpx.URL) else httpx.URL(url.strip())
    except (httpx.InvalidURL, TypeError, UnicodeError, ValueError) as e:
        raise ImageRejected(Reason.FETCH_INVALID_URL, f"{hop}{str(url)[:200]!r}: {e}") from e
    shown = f"{hop}{str(parsed)[:200]!r}"
    if parsed.scheme not in DEFAULT_PORTS:
        raise ImageRejected(Reason.FETCH_INVALID_URL, f"{shown}: scheme {parsed.scheme!r} is not http or https")
    host = parsed.raw_host.decode("ascii", "replace")
    if not host:
        raise ImageRejected(Reason.FETCH_INVALID_URL, f"{shown}: no host")
    if parsed.userinfo:
        raise ImageRejected(Reason.FETCH_INVALID_URL, f"{shown}: credentials in a URL are not sent")
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise ImageRejected(Reason.FETCH_INVALID_URL, f"{shown}: port {parsed.port} is outside 1..65535")
    if ":" in host:
        try:
            literal = ipaddress.IPv6Address(host)
        except ValueError:
            literal = None
        if literal is None or literal.scope_id:
            raise ImageRejected(Reason.FETCH_INVALID_URL, f"{shown}: {host!r} is not an IPv6 address")
    elif not _HOST_NAME.fullmatch(host) or len(host) > 253:
        raise ImageRejected(Reason.FETCH_INVALID_URL, f"{shown}: {host!r} is not a host name")
    return parsed


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
        self._deadline = _Deadline()
        if self.policy.ca_file is None:
            context = httpcore.default_ssl_context()  # certifi's bundle, as httpx
        else:
            context = ssl.create_default_context(cafile=self.policy.ca_file)
        self._pool = httpcore.ConnectionPool(
            ssl_context=context,
            max_connections=None,  # bounded by HOST_SLOTS: per_host per origin
            max_keepalive_connections=KEEPALIVE_CONNECTIONS,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
            network_backend=_CheckedBackend(self.policy.allow_networks, self._deadline),
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
        except _RefusedAddress as e:
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
