"""``python manage.py thumbnails``: draw the thumbnails that are missing, once.

New images get theirs from the worker that decodes them (``services.queues.blobs.thumbnailer``);
this is for images embedded before thumbnails existed (or whose thumbnail write failed). It reads
and decodes each original here, in the command's own process (never in the web process), with the
pipeline's limits, and writes ``thumb/<aa>/<sha256>.webp`` beside the originals. Idempotent: an
existing thumbnail is left alone, so running it again draws nothing.
"""
from django.conf import settings
from django.core.management.base import BaseCommand

from embeddings import runtime
from embeddings.models import Image, ImageStatus
from embeddings.storage import thumbnail_exists, thumbnail_put
from workers.decode import decode_image
from workers.errors import ImageRejected
from workers.thumbnail import thumbnail_bytes


class Command(BaseCommand):
    help = "Draw the missing thumbnails of embedded images (those made before thumbnails existed)."

    def add_arguments(self, parser):
        parser.add_argument("--limit", type=int, default=None, help="stop after this many drawn")

    def handle(self, *args, limit, **opts):

        store, cfg = runtime.blob_store(), settings.PIPELINE
        drawn = failed = present = 0
        rows = (Image.objects.filter(status__in=(ImageStatus.EMBEDDED, ImageStatus.SKIPPED))
                .order_by("sha256", "created_at").values_list("sha256", "storage_key").distinct())
        seen: set[str] = set()
        for sha, key in rows.iterator():
            if sha in seen:
                continue
            seen.add(sha)
            if thumbnail_exists(store, sha):
                present += 1
                continue
            try:
                decoded = decode_image(store.read(key, sha), max_pixels=cfg.max_image_pixels,
                                       max_bytes=cfg.max_image_bytes, min_side=512, timeout_s=cfg.decode_timeout_s)
            except ImageRejected as e:  # the original is gone or changed: nothing to draw from
                failed += 1
                self.stderr.write(f"{sha[:12]}… ({key}): {e}")
                continue
            thumbnail_put(store, sha, thumbnail_bytes(decoded.rgb))
            drawn += 1
            if limit is not None and drawn >= limit:
                break
        self.stdout.write(f"{drawn} thumbnails drawn, {present} already there, {failed} without a readable original")
