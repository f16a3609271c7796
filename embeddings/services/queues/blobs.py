"""What the embedding queues read from and draw into the blob store around a decode: the originals
of a chunk or request (:func:`originals_loader`), the preview and thumbnail drawn from the pixels
just decoded (:func:`thumbnailer`), and the previews a re-embed reads back instead of the originals
(:class:`Previews`, :func:`count_previews`; docs/previews.md).
"""
from __future__ import annotations

import logging

from django.conf import settings

from embeddings import metrics, runtime
from embeddings.storage import (
    preview_delete,
    preview_exists,
    preview_put,
    preview_read,
    thumbnail_exists,
    thumbnail_put,
)
from workers.preview import PreviewTooLong, preview_bytes
from workers.thumbnail import thumbnail_bytes

log = logging.getLogger(__name__)


def originals_loader(rows: dict[str, tuple[str, str]]):
    store = runtime.blob_store()
    return lambda image_id: store.read(*rows[image_id])


def thumbnailer(shas: dict[str, str]):
    """The runner's decode hook (``workers.runner.OnDecoded``): draws the preview (``workers.preview``;
    none when ``PREVIEW_SIDE`` is 0) and the thumbnail of each image (key = image id, ``shas`` maps it
    to its sha256) once each, into the blob store, from the pixels the worker has just decoded; the
    thumbnail from the preview's pixels, which are fewer. An existing one is not drawn again; a
    picture too long for a preview gets none (its re-embeds read the original)."""

    store = runtime.blob_store()
    side = settings.PIPELINE.preview_side

    def on_decoded(image_id: str, rgb, meta) -> None:
        sha = shas.get(image_id)
        if not sha:
            return
        pixels = rgb
        if side and not preview_exists(store, sha):
            try:
                data, pixels = preview_bytes(rgb, width=meta.width, height=meta.height, format=meta.format,
                                             short_side=side)
                preview_put(store, sha, data)
            except PreviewTooLong as e:
                log.info("no preview of %s: %s", image_id, e)
        if not thumbnail_exists(store, sha):
            thumbnail_put(store, sha, thumbnail_bytes(pixels))

    return on_decoded


class LateThumbnails:
    """The decode hook of work someone waits for: keeps each decoded original (``(H, W, 3)`` uint8
    RGB, key = image id, ``shas`` maps it to its sha256) and hands it to :func:`thumbnailer` only
    when :meth:`draw` is called: after the answer (``deferred.after_answer``), since encoding two
    JPEGs and writing them costs the answer a few ms. The thumbnail view waits for a thumbnail
    asked for before it is drawn (``site.thumbnails.THUMBNAIL_LATE_S``)."""

    def __init__(self, shas: dict[str, str]) -> None:
        self.shas = shas
        self.kept: list[tuple] = []  # appended from the runner's decode threads (list.append is atomic)

    def __call__(self, image_id: str, rgb, meta) -> None:
        self.kept.append((image_id, rgb, meta))

    def draw(self) -> None:
        """Draw what was kept, then let the pixels go. A failure is logged and skips that image."""
        on_decoded = thumbnailer(self.shas)
        kept, self.kept = self.kept, []
        for image_id, rgb, meta in kept:
            try:
                on_decoded(image_id, rgb, meta)
            except Exception:  # noqa: BLE001 - as the runner treats a failing hook: the image stands
                log.exception("could not draw the preview or thumbnail of %s", image_id)


class Previews:
    """The previews of a chunk's images in the blob store (``workers.preview.PreviewStore``; key =
    image id, ``shas`` maps it to its sha256)."""

    def __init__(self, shas: dict[str, str]) -> None:
        self.store, self.shas = runtime.blob_store(), shas

    def read(self, key: str) -> bytes:

        return preview_read(self.store, self.shas[key])

    def discard(self, key: str) -> None:

        preview_delete(self.store, self.shas[key])


def count_previews(tally, *, job_id: str) -> None:
    """Count a re-embed chunk's preview reads (``clip_preview_reads_total``) and log its fallbacks
    (each unreadable one was logged as a warning by the runner; a missing one is expected for an
    image embedded before previews existed, or a dual-embedding copy whose upload is not decoded yet)."""
    metrics.count_preview_reads(tally)
    if tally.fallbacks:
        log.info("chunk of job %s: %d previews missing and %d unreadable: their originals were read "
                 "(manage.py previews draws missing ones)", job_id, tally.missing, tally.unreadable)
