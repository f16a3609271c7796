"""Fixtures for the pipeline library's tests."""
from __future__ import annotations

import pytest

from workers.model import EncoderHolder
from workers.runner import BatchRunner


@pytest.fixture(scope="module")
def runner(random_config, encoder):
    """A ``BatchRunner`` with 2 decode threads on the session's loaded random-weights model."""
    holder = EncoderHolder(random_config)
    holder._encoder = encoder  # share the session's loaded model
    r = BatchRunner(random_config.replace(decode_threads=2), holder)
    yield r
    r.close()
