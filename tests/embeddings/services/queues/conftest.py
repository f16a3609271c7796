"""What the queues' tests share: small photos as upload sources, the bulk messages a service sends
captured instead of run, and a look at images' statuses. Run on the session's random-weights
ViT-B-32, an embedded Qdrant and eager Celery; where a service sends work on (a bulk chunk's points
to the vectors worker), the message is captured and read, and the next step is called by hand.
"""
from __future__ import annotations

import io

import pytest

from embeddings import tasks
from embeddings.models import Image, Job, Lane
from embeddings.services.catalogue import images as image_services
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.catalogue.sources import SourceFile
from tests.embeddings.conftest import jpeg_bytes

#: Passes the upload's content check (JPEG magic bytes), fails the worker's decode.
BROKEN_JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 40
DIM = 512  # ViT-B-32's embedding width


def source(name: str, data: bytes) -> SourceFile:
    return SourceFile(name=name, size=len(data), open=lambda: io.BytesIO(data))


def photos(n: int, seed: int) -> list[SourceFile]:
    return [source(f"{seed + i}.jpg", jpeg_bytes(seed + i, (64, 64))) for i in range(n)]


@pytest.fixture
def sent(monkeypatch):
    """Bulk messages captured instead of run: ``{task name: [(args, kwargs, options), ...]}``."""
    out: dict[str, list] = {}
    for task in (tasks.embed_chunk, tasks.index_chunk):
        monkeypatch.setattr(task, "apply_async", lambda args=(), kwargs=None, task=task, **options:
                            out.setdefault(task.name, []).append((args, kwargs, options)))
    return out


def queued_chunk(user, sent, sources: list[SourceFile]) -> tuple[Job, list[str]]:
    """A bulk job of ``sources`` whose one chunk is queued (its message captured, not run)."""
    job = job_services.job_create(owner=user, sources=sources)
    ((job_id, chunk), _, _), = sent.pop("embeddings.tasks.embed_chunk")
    assert job_id == str(job.id)
    return job, chunk


def statuses(ids) -> dict[str, tuple[str, str]]:
    return {str(i): (s, r) for i, s, r in Image.objects.filter(id__in=ids).values_list("id", "status", "reason")}


def interactive_rows(user, sources: list[SourceFile]) -> list[str]:
    rows = image_services.images_create(owner=user, lane=Lane.INTERACTIVE, sources=sources)
    return [str(im.id) for im in rows]
