"""The runner: every stage timed, order kept, bad images fail alone with their reason."""
from __future__ import annotations

import cv2
import numpy as np

from tests.conftest import needs_shared, photo_paths
from workers.errors import ImageRejected, Reason
from workers.timing import STAGES


def jpeg(colour: tuple[int, int, int], size=(240, 320)) -> bytes:
    img = np.zeros((*size, 3), np.uint8)
    img[:] = colour[::-1]
    return cv2.imencode(".jpg", img)[1].tobytes()


def test_bad_images_fail_alone_and_order_is_kept(runner, encoder):
    blobs = {
        "red": jpeg((255, 0, 0)),
        "empty": b"",
        "green": jpeg((0, 255, 0)),
        "text": b"hello, I am not an image at all",
        "missing": None,
        "blue": jpeg((0, 0, 255)),
    }

    def loader(key):
        if blobs[key] is None:
            raise ImageRejected(Reason.SOURCE_MISSING, "gone")
        return blobs[key]

    result = runner.run(list(blobs), loader)
    assert [m.key for m in result.metas] == ["red", "green", "blue"]
    assert {(f.key, f.reason) for f in result.failed} == {
        ("empty", "empty"), ("text", "not_an_image"), ("missing", "source_missing")}
    assert result.vectors.shape == (3, 512)
    # each row is the embedding of its own image, not a neighbour's
    alone = runner.run(["green"], loader)
    np.testing.assert_allclose(alone.vectors[0], result.vectors[1], atol=1e-5)
    assert (result.metas[0].width, result.metas[0].height) == (320, 240)


def test_stage_timings_are_present_and_add_up(runner):
    result = runner.run(["a", "b", "c", "d"], lambda key: jpeg((10, 200, 30)))
    t = result.timings
    assert set(t.as_dict()) == set(STAGES)
    for stage in ("load", "decode", "decode_wait", "preprocess", "embed", "total"):
        assert getattr(t, stage) >= 0
    assert t.decode > 0 and t.embed > 0 and t.preprocess > 0
    # embed runs after the parallel phase, in sequence: the wall total covers it plus the parallel
    # work divided over the decode threads
    parallel = (t.load + t.decode + t.preprocess) / runner.config.decode_threads
    assert t.total >= t.embed
    assert t.total >= t.embed + parallel * 0.5


def test_all_failed_batch_has_no_vectors(runner):
    result = runner.run(["x"], lambda key: b"")
    assert result.vectors.shape == (0, 512) and [f.reason for f in result.failed] == ["empty"]


@needs_shared
def test_real_photos_chunk_of_64(runner):
    """A chunk of 64 real photos with a few bad files: all good ones embedded, each bad one recorded."""
    paths = photo_paths()[:60]
    blobs = {p.name: p.read_bytes() for p in paths}
    blobs.update({"zero.jpg": b"", "doc.jpg": b"\xd0\xcf\x11\xe0 word document", "cut.jpg": blobs[paths[0].name][:5000],
                  "junk.png": b"\x89PNG\r\n\x1a\n" + b"\x00" * 100})
    result = runner.run(list(blobs), blobs.__getitem__)
    assert len(blobs) == 64
    assert len(result.metas) == 60 and result.vectors.shape == (60, 512)
    assert {f.key: f.reason for f in result.failed}.keys() == {"zero.jpg", "doc.jpg", "cut.jpg", "junk.png"}
    assert {f.key: f.reason for f in result.failed}["zero.jpg"] == "empty"
    assert {f.key: f.reason for f in result.failed}["doc.jpg"] == "not_an_image"


def test_an_image_whose_vector_is_not_finite_or_zeros_fails_alone_in_every_pass(runner, encoder, monkeypatch):
    # the wrapped model (tests/workers/test_screen.py): white → +inf (NaN once normalised), black → zeros
    from tests.workers.test_screen import poison

    blobs = {"red": jpeg((255, 0, 0)), "white": jpeg((255, 255, 255)), "green": jpeg((0, 255, 0)),
             "black": jpeg((0, 0, 0)), "blue": jpeg((0, 0, 255)), "white2": jpeg((255, 255, 255), (100, 80))}
    healthy = runner.run(["red", "green", "blue"], blobs.__getitem__)
    poison(encoder, monkeypatch)
    for micro_batch in (None, 2):  # one pass, and the micro-batched passes of a migration chunk
        result = runner.run(list(blobs), blobs.__getitem__, micro_batch=micro_batch)
        assert [m.key for m in result.metas] == ["red", "green", "blue"]
        assert [(f.key, f.reason) for f in result.failed] == [
            ("white", "non_finite_embedding"), ("black", "zero_embedding"), ("white2", "non_finite_embedding")]
        assert result.vectors.shape == (3, 512) and np.isfinite(result.vectors).all()
        np.testing.assert_allclose(result.vectors, healthy.vectors, atol=1e-5)  # the others are the real model's
