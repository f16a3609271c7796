"""``python manage.py previews``: draw the previews that are missing (docs/previews.md).

New images get theirs from the worker that decodes them (``services.queues.blobs.thumbnailer``);
this is for images embedded before previews existed, and for any whose preview was never written
or was found unreadable. It reads and decodes each original here, in the command's own process
(never in the web process), with the pipeline's limits, decoding at a short side of at least
``PREVIEW_SIDE`` (so these previews have exactly that short side, or the whole picture when it is
smaller), and writes ``preview/<aa>/<sha256>`` beside the originals.

Idempotent: an existing preview is left alone, so running it again draws nothing. Batched: the
distinct bytes of embedded (and skipped duplicate) rows are read ``--batch`` at a time in sha256
order (keyset: memory does not grow with the catalogue), each batch decoded on the pipeline's
decode threads.
"""
from __future__ import annotations

import concurrent.futures

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from embeddings import runtime
from embeddings.models import Image, ImageStatus
from embeddings.storage import preview_exists, preview_put
from workers.decode import decode_image
from workers.errors import ImageRejected
from workers.preview import PreviewTooLong, preview_bytes

#: Outcomes counted, in the order reported.
OUTCOMES = ("drawn", "present", "failed", "too_long")


def draw_one(store, cfg, sha: str, keys: list[str]) -> tuple[str, str]:
    """Draw the preview of ``sha`` from the first of its ``keys`` that reads and decodes.

    Returns:
        ``(outcome, detail)``: outcome one of :data:`OUTCOMES`.
    """

    if preview_exists(store, sha):
        return "present", ""
    detail = "no storage key"
    for key in keys:
        try:
            decoded = decode_image(store.read(key, sha), max_pixels=cfg.max_image_pixels,
                                   max_bytes=cfg.max_image_bytes, min_side=cfg.preview_side,
                                   timeout_s=cfg.decode_timeout_s)
        except ImageRejected as e:  # gone, changed, or refused: another row's key may still read
            detail = f"{key}: {e}"
            continue
        try:
            data, _ = preview_bytes(decoded.rgb, width=decoded.width, height=decoded.height, format=decoded.format,
                                    short_side=cfg.preview_side)
        except PreviewTooLong as e:
            return "too_long", str(e)
        preview_put(store, sha, data)
        return "drawn", ""
    return "failed", detail


class Command(BaseCommand):
    help = "Draw the missing previews of embedded images (those made before previews existed, or lost)."

    def add_arguments(self, parser):
        parser.add_argument("--batch", type=int, default=256, help="distinct images read and decoded per batch")
        parser.add_argument("--limit", type=int, default=None, help="stop after this many drawn")

    def handle(self, *args, batch, limit, **opts):
        cfg = settings.PIPELINE
        if not cfg.preview_side:
            raise CommandError("PREVIEW_SIDE is 0: previews are off")
        if batch < 1:
            raise CommandError("--batch must be at least 1")
        store = runtime.blob_store()
        counts = dict.fromkeys(OUTCOMES, 0)
        rows = Image.objects.filter(status__in=(ImageStatus.EMBEDDED, ImageStatus.SKIPPED)).exclude(sha256="")
        last = ""
        with concurrent.futures.ThreadPoolExecutor(max_workers=cfg.threads().decode) as pool:
            while limit is None or counts["drawn"] < limit:
                size = batch if limit is None else min(batch, limit - counts["drawn"])  # never past --limit
                shas = list(rows.filter(sha256__gt=last).order_by("sha256").values_list("sha256", flat=True)
                            .distinct()[:size])
                if not shas:
                    break
                last = shas[-1]
                keys: dict[str, list[str]] = {s: [] for s in shas}
                for sha, key in rows.filter(sha256__in=shas).values_list("sha256", "storage_key").distinct():
                    if key and key not in keys[sha]:
                        keys[sha].append(key)
                drawn = pool.map(draw_one, [store] * len(shas), [cfg] * len(shas), shas, [keys[s] for s in shas])
                for sha, (outcome, detail) in zip(shas, drawn):
                    counts[outcome] += 1
                    if outcome in ("failed", "too_long"):
                        self.stderr.write(f"{sha[:12]}…: {outcome}: {detail}")
        self.stdout.write(f"{counts['drawn']} previews drawn, {counts['present']} already there, {counts['failed']} "
                          f"without a readable original, {counts['too_long']} too long for a preview")
