"""The network under httpcore: the checked backend (every address checked, the socket connects to
the checked address), the whole-fetch deadline at every socket operation, per-host slots, resolution."""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import ssl
import threading
import time
import typing
from collections.abc import Iterable, Iterator

import httpcore

from .rules import IPAddress, IPNetwork, address_refusal

#: One logger for the package (operators filter on ``workers.fetch``); refusals log the resolved address here.
log = logging.getLogger("workers.fetch")


class HostSlots:
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
HOST_SLOTS = HostSlots()


class Deadline(threading.local):
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


class RefusedAddress(Exception):
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

    def __init__(self, stream: httpcore.NetworkStream, deadline: Deadline) -> None:
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


class CheckedBackend(httpcore.NetworkBackend):
    """httpcore's network backend that resolves the host itself, refuses it when any address is
    refused, and connects to the checked address (no second lookup)."""

    def __init__(self, allow_networks: tuple[IPNetwork, ...], deadline: Deadline) -> None:
        self._allow = allow_networks
        self._deadline = deadline
        self._sockets = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None) -> httpcore.NetworkStream:
        addresses = resolve(host, port)
        for address in addresses:
            why = address_refusal(address, self._allow)
            if why is not None:
                raise RefusedAddress(host, address, why)
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
