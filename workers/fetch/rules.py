"""What may be fetched and how it is answered: the policy, the URL and address rules, Retry-After,
and the results (:class:`Fetched`, :class:`Posted`)."""
from __future__ import annotations

import dataclasses
import datetime
import email.utils
import ipaddress
import re
import time
from collections.abc import Iterable

import httpx

from workers.errors import ImageRejected, Reason

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
HOST_NAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?")


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
    elif not HOST_NAME.fullmatch(host) or len(host) > 253:
        raise ImageRejected(Reason.FETCH_INVALID_URL, f"{shown}: {host!r} is not a host name")
    return parsed
