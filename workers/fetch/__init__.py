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
  and hosts file, not the sender's to learn. The address is logged (INFO, the package's logger ``workers.fetch``),
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

No Django, Celery or torch here: this package is a plain library. Its modules: ``rules`` (policy,
URL and address rules, results), ``transport`` (the checked network backend, deadline, per-host
slots), ``fetcher`` (:class:`Fetcher`); every name is importable from ``workers.fetch``.
"""
from __future__ import annotations

from .fetcher import Fetcher
from .rules import (
    DEFAULT_PORTS,
    DRAIN_BYTES,
    HOST_NAME,
    KEEPALIVE_CONNECTIONS,
    KEEPALIVE_EXPIRY_S,
    POST_ANSWER_BYTES,
    REDIRECT_STATUSES,
    RETRY_STATUSES,
    SHARED_ADDRESS_SPACE,
    Fetched,
    FetchPolicy,
    IPAddress,
    IPNetwork,
    Posted,
    address_refusal,
    parse_url,
    retry_after_s,
)
from .transport import HOST_SLOTS, HostSlots, resolve

__all__ = ["DEFAULT_PORTS", "DRAIN_BYTES", "HOST_NAME", "HOST_SLOTS", "KEEPALIVE_CONNECTIONS", "KEEPALIVE_EXPIRY_S",
           "POST_ANSWER_BYTES", "REDIRECT_STATUSES", "RETRY_STATUSES", "SHARED_ADDRESS_SPACE", "FetchPolicy", "Fetched",
           "Fetcher", "HostSlots", "IPAddress", "IPNetwork", "Posted", "address_refusal", "parse_url", "resolve",
           "retry_after_s"]
