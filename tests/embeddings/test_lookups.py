"""``field__any_of`` (embeddings/lookups.py): the rows ``__in`` finds, one array parameter on PostgreSQL."""
from __future__ import annotations

import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from embeddings.models import Image, ImageStatus, Lane

pytestmark = pytest.mark.django_db


def rows(user, n: int) -> list[Image]:
    return Image.objects.bulk_create([
        Image(owner=user, lane=Lane.BULK, status=ImageStatus.QUEUED, sha256=f"{i:064x}", size_bytes=0,
              storage_key=f"k/{i}", model_id="m", point_id=uuid.UUID(int=i + 1)) for i in range(n)])


def test_any_of_finds_what_in_finds(user):
    made = rows(user, 40)
    wanted = [str(r.id) for r in made[::3]]
    shas = [r.sha256 for r in made[5:12]]
    assert set(Image.objects.filter(id__any_of=wanted)) == set(Image.objects.filter(id__in=wanted))
    assert len(Image.objects.filter(id__any_of=wanted)) == 14
    assert [r.sha256 for r in Image.objects.filter(sha256__any_of=shas).order_by("sha256")] == shas
    points = [r.point_id for r in made[:4]]
    assert Image.objects.filter(point_id__any_of=points, sha256__any_of=shas).count() == 0
    assert Image.objects.filter(point_id__any_of=[*points, None]).count() == 4  # None matches nothing, as IN


def test_any_of_an_empty_list_matches_nothing(user):
    rows(user, 3)
    assert Image.objects.filter(id__any_of=[]).count() == 0
    assert Image.objects.filter(id__any_of=[None]).count() == 0


def test_any_of_is_one_parameter_on_postgresql_and_in_elsewhere(user):
    made = rows(user, 30)
    with CaptureQueriesContext(connection) as q:
        assert Image.objects.filter(id__any_of=[r.id for r in made]).count() == 30
    sql = q.captured_queries[0]["sql"]
    if connection.vendor == "postgresql":
        assert "= ANY(" in sql and " IN (" not in sql
    else:
        assert " IN (" in sql
