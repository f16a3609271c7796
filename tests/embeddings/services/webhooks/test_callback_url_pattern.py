"""``CALLBACK_URL_PATTERN``, the callback URL form that the schema states and the service checks
first: every URL it matches passes the fetcher's URL rules too (the service never refuses the form of
a URL the schema allows); a URL it does not match is refused with ``invalid_callback_url``."""
from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from embeddings.errors import ApplicationError
from embeddings.services.webhooks.endpoints import CALLBACK_URL_PATTERN, callback_url_check

pytestmark = pytest.mark.django_db


@settings(max_examples=400, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(url=st.from_regex(CALLBACK_URL_PATTERN, fullmatch=True).filter(lambda u: len(u) <= 2048))
def test_every_url_the_pattern_allows_has_a_form_the_service_takes(url):
    try:
        callback_url_check(url)
    except ApplicationError as e:  # a literal address in a refused network: a rule about the address
        assert e.code == "fetch_refused_address", (url, str(e))


@pytest.mark.parametrize("url", ["http://", "ftp://example.com/", "http://u:p@example.com/", "http://999.1.1.1/",
                                 "http://[1::2::3]/", "https://example.com:0/", "https://example.com:65536/",
                                 "http://a..b/", " http://example.com/", "http://example.com/a b",
                                 "http://" + "a" * 254 + "/"])
def test_a_url_the_pattern_refuses_is_an_invalid_callback_url(url):
    assert not re.fullmatch(CALLBACK_URL_PATTERN, url)
    with pytest.raises(ApplicationError) as e:
        callback_url_check(url)
    assert e.value.code == "invalid_callback_url"


@pytest.mark.parametrize("url", ["https://example.com/hook", "HTTP://Example.COM:8080/a?b#c", "http://1.2.3.4.5/",
                                 "http://a_b.example./", "https://[2606:4700::1111]/x", "http://8.8.8.8:65535"])
def test_ordinary_urls_are_taken(url):
    assert re.fullmatch(CALLBACK_URL_PATTERN, url)
    callback_url_check(url)
