"""Tests of :mod:`workers.fetch` against a real HTTP(S) origin (``tests/origin_server.py``).

The policies allow 127.0.0.1/32 only (the origin's address) and use short timeouts; every assertion
about what reached the server reads the server's own records.
"""
from __future__ import annotations

import hashlib
import io
import ipaddress
import socket
import threading

import pytest
from PIL import Image

from tests.conftest import manifest_rows, needs_shared
from tests.origin_server import OriginServer
from workers.decode import decode_image
from workers.errors import ImageRejected, Reason
from workers.fetch import (
    HOST_SLOTS,
    Fetched,
    Fetcher,
    FetchPolicy,
    address_refusal,
    retry_after_s,
)

#: The tests' allowance: the origin's address and nothing else.
LOOPBACK = ("127.0.0.1/32",)


def policy(**changes) -> FetchPolicy:
    """A test policy: loopback allowed, short timeouts, no retries, backoff of a few ms."""
    base = {"allow_networks": LOOPBACK, "connect_timeout_s": 2.0, "read_timeout_s": 2.0, "total_timeout_s": 10.0,
            "retries": 0, "backoff_base_s": 0.01, "backoff_max_s": 0.05, "max_bytes": 1_000_000}
    return FetchPolicy(**(base | changes))


def rejected(fetcher: Fetcher, url: str) -> ImageRejected:
    with pytest.raises(ImageRejected) as info:
        fetcher.fetch(url)
    return info.value


@pytest.fixture(scope="module")
def origin():
    with OriginServer() as server:
        yield server


@pytest.fixture(scope="module")
def tls_origin():
    with OriginServer(tls=True) as server:
        yield server


@pytest.fixture
def server(origin):
    """The module's origin with its records cleared."""
    origin.wait_idle()
    origin.reset()
    return origin


@pytest.fixture
def fake_dns(monkeypatch):
    """Names of our own for ``socket.getaddrinfo``: ``{name: [address per lookup...]}`` (the last
    one repeats); every other name goes to the real resolver. Returns the lookups made, by name."""
    real = socket.getaddrinfo
    names: dict[str, list[str]] = {}
    lookups: dict[str, int] = {}

    def getaddrinfo(host, port, *args, **kwargs):
        if host in names:
            n = lookups.get(host, 0)
            lookups[host] = n + 1
            answers = names[host]
            return real(answers[min(n, len(answers) - 1)], port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return names, lookups


# ---- bodies ----------------------------------------------------------------------------------

@needs_shared
def test_photo_is_fetched_whole(server):
    row = next(r for r in manifest_rows("photos/") if r["path"] == f"photos/{server.photo}")
    url = f"{server.url}/photo/{server.photo}"
    with Fetcher(policy()) as fetcher:
        got = fetcher.fetch(url)
    assert hashlib.sha256(got.data).hexdigest() == row["sha256"]
    assert len(got.data) == int(row["bytes"])
    assert (got.url, got.final_url, got.status, got.content_type) == (url, url, 200, "image/jpeg")
    assert (got.attempts, got.redirects) == (1, 0)
    assert server.count(f"/photo/{server.photo}") == 1


def test_numbered_images_are_distinct_and_decode(server):
    with Fetcher(policy()) as fetcher:
        got = [fetcher.fetch(f"{server.url}/img/{n}.jpg") for n in (0, 1, 2, 10)]
    assert [g.data for g in got] == [server.jpeg + str(n).encode() for n in (0, 1, 2, 10)]
    assert len({hashlib.sha256(g.data).digest() for g in got}) == 4
    assert all(decode_image(g.data).rgb.shape == (16, 16, 3) for g in got)
    assert Image.open(io.BytesIO(got[3].data)).size == (16, 16)


# ---- addresses (server-side request forgery) -------------------------------------------------

def test_loopback_is_refused_before_any_request_without_the_allowance(server):
    urls = [f"{server.url}/img/1.jpg", f"http://localhost:{server.port}/img/1.jpg",
            f"http://2130706433:{server.port}/img/1.jpg", f"http://127.1:{server.port}/img/1.jpg",
            f"http://0.0.0.0:{server.port}/img/1.jpg"]
    with Fetcher(FetchPolicy(retries=2)) as fetcher:
        errors = [rejected(fetcher, url) for url in urls]
    assert [e.reason for e in errors] == [Reason.FETCH_REFUSED_ADDRESS] * 5
    allow = "refused unless FETCH_ALLOW_NETWORKS allows it"
    assert errors[0].detail == f"{urls[0]}: 127.0.0.1 is a loopback address, {allow}"
    # a name: the rule, never the address it resolved to here
    assert errors[1].detail == f"{urls[1]}: localhost resolves to a loopback address, {allow}"
    assert errors[2].detail == f"{urls[2]}: 2130706433 resolves to a loopback address, {allow}"
    assert errors[4].detail == f"{urls[4]}: 0.0.0.0 is an unspecified address, {allow}"
    assert (server.count(), server.connections_opened) == (0, 0)


@pytest.mark.parametrize(("host", "allow", "why"), [
    ("[::1]", LOOPBACK, "loopback"),  # 127.0.0.1/32 allows no IPv6 loopback
    ("[::ffff:127.0.0.1]", (), "loopback"),  # IPv4-mapped IPv6 judged as its IPv4 address
])
def test_ipv6_literal_of_loopback_is_refused(server, host, allow, why):
    with Fetcher(policy(allow_networks=allow)) as fetcher:
        error = rejected(fetcher, f"http://{host}:{server.port}/img/1.jpg")
    assert error.reason == Reason.FETCH_REFUSED_ADDRESS
    assert error.detail.endswith(f" {why} address, refused unless FETCH_ALLOW_NETWORKS allows it")
    assert (server.count(), server.connections_opened) == (0, 0)


@pytest.mark.parametrize(("target", "why"), [
    ("http://169.254.169.254/latest/meta-data/", "link-local"),  # cloud metadata
    ("http://10.0.0.1/", "private"),
    ("http://[fd00:ec2::254]/", "private"),  # cloud metadata over IPv6
    ("http://100.100.100.200/", "shared address space"),
    ("http://[::]/", "unspecified"),
])
def test_redirect_to_an_inside_address_is_refused_even_with_loopback_allowed(server, target, why):
    with Fetcher(policy(retries=2)) as fetcher:
        error = rejected(fetcher, f"{server.url}/redirect-to?url={target}")
    assert error.reason == Reason.FETCH_REFUSED_ADDRESS
    assert error.detail.endswith(f" {why} address, refused unless FETCH_ALLOW_NETWORKS allows it")
    assert server.count() == 1  # the redirect itself, nothing after


@pytest.mark.parametrize(("address", "why"), [
    ("127.0.0.1", "loopback"), ("127.255.0.9", "loopback"), ("::1", "loopback"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.0.1", "private"), ("fc00::1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("224.0.0.1", "multicast"), ("ff02::1", "multicast"),
    ("240.0.0.1", "reserved"), ("255.255.255.255", "reserved"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("100.64.0.1", "shared address space"),
    ("::ffff:10.0.0.1", "private"), ("::ffff:169.254.169.254", "link-local"),
    ("192.0.2.1", "private"),  # documentation range: Python counts it private
    ("2002:7f00:1::", "6to4-wrapped loopback"),
    ("8.8.8.8", None), ("2001:4860:4860::8888", None), ("::ffff:8.8.8.8", None),
])
def test_address_refusal(address, why):
    assert address_refusal(ipaddress.ip_address(address)) == why


def test_address_refusal_allowance_is_exact():
    allow = (ipaddress.ip_network("127.0.0.1/32"),)
    assert address_refusal(ipaddress.ip_address("127.0.0.1"), allow) is None
    assert address_refusal(ipaddress.ip_address("::ffff:127.0.0.1"), allow) is None
    assert address_refusal(ipaddress.ip_address("127.0.0.2"), allow) == "loopback"
    assert address_refusal(ipaddress.ip_address("::1"), allow) == "loopback"


def test_connection_goes_to_the_checked_address_without_a_second_lookup(server, fake_dns):
    """DNS rebinding: the name answers loopback (allowed) once, then a private address; the fetch
    connects to the address it checked, and a new fetcher (new connection) is checked again."""
    names, lookups = fake_dns
    names["rebind.test"] = ["127.0.0.1", "10.0.0.1"]
    with Fetcher(policy()) as fetcher:
        first = fetcher.fetch(f"http://rebind.test:{server.port}/img/5.jpg")
        second = fetcher.fetch(f"http://rebind.test:{server.port}/img/6.jpg")  # the kept-alive connection
    assert (first.data, second.data) == (server.jpeg + b"5", server.jpeg + b"6")
    assert lookups["rebind.test"] == 1
    assert server.connections_opened == 1
    with Fetcher(policy()) as fetcher:
        error = rejected(fetcher, f"http://rebind.test:{server.port}/img/7.jpg")
    assert (error.reason, error.detail) == (Reason.FETCH_REFUSED_ADDRESS, f"http://rebind.test:{server.port}/img/7.jpg: "
                                            "rebind.test resolves to a private address, refused unless FETCH_ALLOW_NETWORKS allows it")
    assert lookups["rebind.test"] == 2
    assert server.count() == 2


def test_a_name_with_any_refused_address_is_refused(server, monkeypatch):
    real = socket.getaddrinfo

    def two_answers(host, port, *args, **kwargs):
        if host == "mixed.test":  # one allowed address, one private one
            return real("127.0.0.1", port, *args, **kwargs) + real("10.0.0.1", port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", two_answers)
    with Fetcher(policy()) as fetcher:
        error = rejected(fetcher, f"http://mixed.test:{server.port}/img/1.jpg")
    assert (error.reason, error.detail) == (Reason.FETCH_REFUSED_ADDRESS, f"http://mixed.test:{server.port}/img/1.jpg: "
                                            "mixed.test resolves to a private address, refused unless FETCH_ALLOW_NETWORKS allows it")
    assert server.count() == 0


@pytest.mark.parametrize(("address", "why"), [("10.20.30.40", "private"), ("127.3.4.5", "loopback"),
                                              ("169.254.169.254", "link-local"), ("100.64.7.8", "shared address space"),
                                              ("::ffff:192.168.44.55", "private")])
def test_a_refusal_never_tells_what_a_name_resolves_to(server, fake_dns, caplog, address, why):
    """What a name resolves to on this server (its hosts file, its internal DNS) stays on the server:
    the refusal names the URL, the host and the rule; the address is in the server's log only.
    The same for a redirect hop and for a POST (webhooks)."""
    names, _ = fake_dns
    names["intranet.test"] = [address]
    url = f"http://intranet.test:{server.port}/img/1.jpg"
    hop = f"{server.url}/redirect-to?url=http%3A%2F%2Fintranet.test%2Fa.jpg"
    kind = f"{'an' if why[0] in 'aeiou' else 'a'} {why} address"
    with caplog.at_level("INFO", logger="workers.fetch"), Fetcher(policy()) as fetcher:
        errors = [rejected(fetcher, url), rejected(fetcher, hop)]
        with pytest.raises(ImageRejected) as posted:
            fetcher.post(url, b"{}")
    errors.append(posted.value)
    assert [(e.reason, e.detail) for e in errors] == [
        (Reason.FETCH_REFUSED_ADDRESS, f"{url}: intranet.test resolves to {kind}, refused unless FETCH_ALLOW_NETWORKS allows it"),
        (Reason.FETCH_REFUSED_ADDRESS, "http://intranet.test/a.jpg: intranet.test resolves to "
                                       f"{kind}, refused unless FETCH_ALLOW_NETWORKS allows it"),
        (Reason.FETCH_REFUSED_ADDRESS, f"{url}: intranet.test resolves to {kind}, refused unless FETCH_ALLOW_NETWORKS allows it"),
    ]
    shown = ipaddress.ip_address(address)
    forms = {address, str(shown), str(getattr(shown, "ipv4_mapped", None) or shown)}
    assert not any(f in e.detail for e in errors for f in forms)
    assert sum(f"intranet.test resolves to {shown}" in r.getMessage() for r in caplog.records) == 3


# ---- URLs -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("url", "words"), [
    ("file:///etc/passwd", "scheme 'file'"),
    ("gopher://127.0.0.1:70/_x", "scheme 'gopher'"),
    ("ftp://127.0.0.1/a.jpg", "scheme 'ftp'"),
    ("javascript:alert(1)", "scheme 'javascript'"),
    ("/img/1.jpg", "scheme ''"),
    ("http:///img/1.jpg", "no host"),
    ("http://user:secret@127.0.0.1/img/1.jpg", "credentials"),
    ("http://127.0.0.1:99999/img/1.jpg", "port 99999"),
    ("http://127.0.0.1:0/img/1.jpg", "port 0"),
    ("http://exa mple.com/", "is not a host name"),
    ("http://[fe80::1%25eth0]/", "is not an IPv6 address"),
])
def test_invalid_urls_are_refused(url, words):
    with Fetcher(policy()) as fetcher:
        error = rejected(fetcher, url)
    assert error.reason == Reason.FETCH_INVALID_URL
    assert words in error.detail


def test_redirect_to_another_scheme_is_refused(server):
    with Fetcher(policy()) as fetcher:
        error = rejected(fetcher, f"{server.url}/redirect-to?url=file:///etc/passwd")
    assert error.reason == Reason.FETCH_INVALID_URL
    assert "redirect 1 from" in error.detail and "scheme 'file'" in error.detail


# ---- TLS --------------------------------------------------------------------------------------

def test_self_signed_certificate_fails_tls(tls_origin):
    tls_origin.reset()
    with Fetcher(policy(retries=2)) as fetcher:
        error = rejected(fetcher, f"{tls_origin.url}/img/1.jpg")
    assert error.reason == Reason.FETCH_TLS
    assert "self-signed certificate" in error.detail or "self signed certificate" in error.detail
    assert tls_origin.count() == 0  # not retried: a certificate does not mend itself


def test_trusted_certificate_is_checked_against_the_url_host(fake_dns):
    """Trusted CA, certificate for origin.test: fetched by that name (connected to the checked
    127.0.0.1, SNI and host name check on the name); by its IP address it is a host name mismatch."""
    names, lookups = fake_dns
    names["origin.test"] = ["127.0.0.1"]
    with OriginServer(tls=True, tls_names=("origin.test",)) as origin:
        with Fetcher(policy(ca_file=str(origin.cert_path))) as fetcher:
            got = fetcher.fetch(f"https://origin.test:{origin.port}/img/3.jpg")
            error = rejected(fetcher, f"https://127.0.0.1:{origin.port}/img/3.jpg")
        assert got.data == origin.jpeg + b"3"
        assert error.reason == Reason.FETCH_TLS
        assert "mismatch" in error.detail
        assert origin.count() == 1
    assert lookups["origin.test"] == 1


# ---- statuses and retries ---------------------------------------------------------------------

def test_retry_after_is_honoured(server):
    with Fetcher(policy(retries=3)) as fetcher:
        got = fetcher.fetch(f"{server.url}/ratelimit/honour")
    assert (got.status, got.attempts, got.data) == (200, 2, server.jpeg)
    first, second = server.requests("/ratelimit/honour")
    assert first.status == 429 and second.status == 200
    assert second.started - first.started >= 1.0  # the server's own clock
    assert server.count() == 2


def test_retry_after_above_the_limit_is_not_waited(server):
    with Fetcher(policy(retries=3, retry_after_max_s=5)) as fetcher:
        error = rejected(fetcher, f"{server.url}/ratelimit/patience?after=120")
    assert error.reason == Reason.FETCH_STATUS
    assert "HTTP 429" in error.detail and "Retry-After 120 s" in error.detail
    assert server.count() == 1


def test_retry_after_parsing():
    now = 1_445_412_478.0  # Wed, 21 Oct 2015 07:27:58 GMT
    assert retry_after_s("5") == 5.0
    assert retry_after_s(" 120 ") == 120.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", now=now) == 2.0
    assert retry_after_s("Wed, 21 Oct 2015 07:27:00 GMT", now=now) == 0.0
    assert retry_after_s("soon") is None
    assert retry_after_s("-1") is None
    assert retry_after_s(None) is None


def test_a_server_error_is_retried(server):
    with Fetcher(policy(retries=2)) as fetcher:
        got = fetcher.fetch(f"{server.url}/flaky/once")
    assert (got.attempts, got.data) == (2, server.jpeg + b"once")
    assert [s.status for s in server.requests("/flaky/once")] == [500, 200]


@pytest.mark.parametrize("code", [429, 500, 502, 503, 504])
def test_retried_statuses_spend_every_attempt(server, code):
    with Fetcher(policy(retries=2)) as fetcher:
        error = rejected(fetcher, f"{server.url}/status/{code}")
    assert error.reason == Reason.FETCH_STATUS
    assert f"HTTP {code}" in error.detail and "(after 3 attempts)" in error.detail
    assert server.count(f"/status/{code}") == 3


@pytest.mark.parametrize("code", [400, 401, 403, 404, 410, 304])
def test_other_statuses_fail_at_once(server, code):
    with Fetcher(policy(retries=3)) as fetcher:
        error = rejected(fetcher, f"{server.url}/status/{code}")
    assert error.reason == Reason.FETCH_STATUS
    assert error.detail.startswith(f"HTTP {code} ")
    assert server.count() == 1


def test_no_retry_starts_after_the_total_timeout(server):
    with Fetcher(policy(retries=5, total_timeout_s=1.5)) as fetcher:
        error = rejected(fetcher, f"{server.url}/status/503?retry_after=3")
    assert error.reason == Reason.FETCH_STATUS
    assert "would pass the total time limit of 1.5 s" in error.detail
    assert server.count() == 1


# ---- time limits ------------------------------------------------------------------------------

def test_read_timeout_is_retried_then_fails(server):
    with Fetcher(policy(read_timeout_s=0.3, retries=1)) as fetcher:
        error = rejected(fetcher, f"{server.url}/slow?interval=1&bytes=2")
    assert error.reason == Reason.FETCH_TIMEOUT
    assert error.detail == f"127.0.0.1:{server.port}: no data for 0.3 s (after 2 attempts)"
    assert server.count("/slow") == 2


def test_total_timeout_cuts_a_dripping_body(server):
    with Fetcher(policy(read_timeout_s=2.0, total_timeout_s=1.2, retries=3)) as fetcher:
        error = rejected(fetcher, f"{server.url}/slow?interval=0.3&bytes=20")
    assert error.reason == Reason.FETCH_TIMEOUT
    assert error.detail == f"127.0.0.1:{server.port}: the total time limit of 1.2 s passed"
    assert server.wait_idle()
    (seen,) = server.requests("/slow")
    assert not seen.completed and seen.bytes_sent < 20


def test_connect_timeout():
    """A listener whose accept queue is full drops new connection attempts: connect times out."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    pending = []
    try:
        for _ in range(16):  # fill the accept queue until a connect attempt hangs
            probe = socket.socket()
            probe.settimeout(0.2)
            try:
                probe.connect(("127.0.0.1", port))
            except TimeoutError:
                probe.close()
                break
            pending.append(probe)
        else:
            pytest.skip("this kernel never drops connection attempts to a full accept queue")
        with Fetcher(policy(connect_timeout_s=0.3)) as fetcher:
            error = rejected(fetcher, f"http://127.0.0.1:{port}/img/1.jpg")
        assert (error.reason, error.detail) == (Reason.FETCH_TIMEOUT, f"127.0.0.1:{port}: no connection within 0.3 s")
    finally:
        for probe in pending:
            probe.close()
        listener.close()


# ---- connections ------------------------------------------------------------------------------

def test_connection_refused_is_retried_then_fails():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        with Fetcher(policy(retries=1)) as fetcher:
            error = rejected(fetcher, f"http://127.0.0.1:{port}/img/1.jpg")
    assert error.reason == Reason.FETCH_CONNECT
    assert error.detail.startswith(f"127.0.0.1:{port}: ") and error.detail.endswith("(after 2 attempts)")


def test_unresolvable_host_fails_connect():
    with Fetcher(policy()) as fetcher:
        error = rejected(fetcher, "http://no-such-host.invalid/img/1.jpg")  # RFC 2606: never resolves
    assert error.reason == Reason.FETCH_CONNECT
    assert "cannot resolve no-such-host.invalid" in error.detail


# ---- sizes ------------------------------------------------------------------------------------

def test_content_length_over_the_cap_fails_before_the_body_is_read(server):
    with Fetcher(policy(max_bytes=1_000_000)) as fetcher:
        error = rejected(fetcher, f"{server.url}/big?bytes=50000000&length=1")
    assert (error.reason, error.detail) == (
        Reason.FETCH_TOO_LARGE,
        f"{server.url}/big?bytes=50000000&length=1: Content-Length 50000000 bytes is above the cap of 1000000 bytes")
    assert server.wait_idle()
    (seen,) = server.requests("/big")
    assert not seen.completed and seen.bytes_sent < 50_000_000


def test_chunked_body_is_cut_at_the_cap_while_streaming(server):
    with Fetcher(policy(max_bytes=1_000_000)) as fetcher:
        error = rejected(fetcher, f"{server.url}/big?bytes=50000000")
        after = fetcher.fetch(f"{server.url}/big?bytes=1000000")  # exactly the cap is accepted
    assert (error.reason, error.detail) == (
        Reason.FETCH_TOO_LARGE,
        f"{server.url}/big?bytes=50000000: the body passed the cap of 1000000 bytes while streaming")
    assert after.data == b"\xab" * 1_000_000
    assert server.wait_idle()
    cut, whole = server.requests("/big")
    assert not cut.completed and cut.bytes_sent < 50_000_000
    assert whole.completed


def test_body_longer_than_its_content_length_fails_and_drops_the_connection(server):
    with Fetcher(policy(retries=1)) as fetcher:
        error = rejected(fetcher, f"{server.url}/lying-length")
        after = fetcher.fetch(f"{server.url}/img/8.jpg")
    half = len(server.jpeg)  # the route announces half the body it sends
    assert error.reason == Reason.FETCH_TOO_LARGE
    assert f"longer than its Content-Length of {half} bytes" in error.detail
    assert (after.data, after.attempts) == (server.jpeg + b"8", 1)
    (lying,), (next_one,) = server.requests("/lying-length"), server.requests("/img/8.jpg")
    assert lying.connection != next_one.connection  # the connection with the surplus was not reused


def test_body_shorter_than_its_content_length_fails_connect(server):
    with Fetcher(policy(retries=1)) as fetcher:
        error = rejected(fetcher, f"{server.url}/short-length")
    size = len(server.jpeg)
    assert error.reason == Reason.FETCH_CONNECT
    assert f"received {size} bytes, expected {2 * size}" in error.detail
    assert server.count("/short-length") == 2


# ---- redirects --------------------------------------------------------------------------------

@needs_shared
def test_redirect_chain_is_followed(server):
    with Fetcher(policy()) as fetcher:
        got = fetcher.fetch(f"{server.url}/redirect/3")
    assert got.redirects == 3 and got.attempts == 1
    assert got.final_url == f"{server.url}/photo/{server.photo}"
    assert got.data == server.photo_bytes(server.photo)
    assert [s.path for s in server.requests()] == [
        "/redirect/3", "/redirect/2", "/redirect/1", f"/photo/{server.photo}"]


def test_too_many_redirects(server):
    with Fetcher(policy(max_redirects=5)) as fetcher:
        error = rejected(fetcher, f"{server.url}/redirect/9")
    assert (error.reason, error.detail) == (Reason.FETCH_REDIRECTS,
                                            f"more than 5 redirects (last from {server.url}/redirect/4)")
    assert [s.path for s in server.requests()] == [f"/redirect/{n}" for n in (9, 8, 7, 6, 5, 4)]


def test_redirect_without_location(server):
    with Fetcher(policy()) as fetcher:
        error = rejected(fetcher, f"{server.url}/redirect-to")
    assert (error.reason, error.detail) == (
        Reason.FETCH_REDIRECTS, f"HTTP 302 from {server.url}/redirect-to without a Location")


# ---- many URLs, concurrency ---------------------------------------------------------------------

def test_fetch_many_keeps_input_order_and_isolates_failures(server):
    urls = [f"{server.url}/img/{n}.jpg" for n in range(6)]
    urls[1] = f"{server.url}/status/404"
    urls[3] = "ftp://example.com/a.jpg"
    urls[4] = f"{server.url}/redirect-to?url=http://169.254.169.254/"
    urls.append(None)  # a manifest's missing cell
    with Fetcher(policy()) as fetcher:
        out = fetcher.fetch_many(urls, threads=4)
    assert [o.reason if isinstance(o, ImageRejected) else o.data for o in out] == [
        server.jpeg + b"0", Reason.FETCH_STATUS, server.jpeg + b"2", Reason.FETCH_INVALID_URL,
        Reason.FETCH_REFUSED_ADDRESS, server.jpeg + b"5", Reason.FETCH_INVALID_URL]
    assert all(isinstance(o, Fetched) and o.url == u for o, u in zip(out, urls) if not isinstance(o, ImageRejected))


def test_per_host_concurrency_is_bounded_across_threads_and_fetchers(server):
    """32 URLs on 16 threads, twice at once from two fetchers: never more than per_host in flight."""
    urls = [f"{server.url}/img/{n}.jpg?delay=0.05" for n in range(32)]
    results: dict[str, list] = {}

    def run(name: str) -> None:
        with Fetcher(policy(per_host=3)) as fetcher:
            results[name] = fetcher.fetch_many(urls, threads=16)

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in ("a", "b"):
        assert [r.data for r in results[name]] == [server.jpeg + str(n).encode() for n in range(32)]
    assert server.count() == 64
    assert server.max_in_flight == 3
    assert server.connections_opened <= 6  # each fetcher's pool: at most per_host connections
    assert HOST_SLOTS.busy(("http", "127.0.0.1", server.port)) == 0


# ---- policy -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value"), [
    ("connect_timeout_s", 0), ("read_timeout_s", -1), ("total_timeout_s", "60"), ("max_bytes", 0),
    ("max_redirects", -1), ("retries", 1.5), ("backoff_base_s", -0.1), ("retry_after_max_s", -1),
    ("per_host", 0), ("allow_networks", "127.0.0.1/32"), ("allow_networks", ("10.0.0.1/8",)),
    ("user_agent", ""), ("user_agent", "a\r\nX-Injected: 1"),
])
def test_policy_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        FetchPolicy(**{field: value})


def test_policy_keeps_networks():
    assert FetchPolicy(allow_networks=("127.0.0.1", "fd00::/8")).allow_networks == (
        ipaddress.ip_network("127.0.0.1/32"), ipaddress.ip_network("fd00::/8"))
    assert FetchPolicy().allow_networks == ()
