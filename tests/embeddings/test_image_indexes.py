"""``embeddings_image``'s indexes as the migrations leave them: every foreign key has an index that
leads with it (look-ups by it, and the cascade when its owner, job or source row goes), and no index
is only the first column of another (each one more for every insert and mark to write).
"""
from __future__ import annotations

import pytest
from django.db import connection

from embeddings.models import Image

pytestmark = pytest.mark.django_db


def image_indexes() -> dict[str, tuple[list[str], bool]]:
    """``{name: (columns, unique)}`` of the table's indexes (primary key and unique constraints included)."""
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, Image._meta.db_table)
    return {name: (c["columns"], bool(c["unique"])) for name, c in found.items()
            if c["index"] or c["unique"] or c["primary_key"]}


def test_every_foreign_key_leads_an_index_and_no_index_is_the_prefix_of_another():
    found = image_indexes()
    indexes = {name: cols for name, (cols, _) in found.items()}
    leading = {cols[0] for cols in indexes.values() if cols}
    foreign = [f.column for f in Image._meta.concrete_fields if f.is_relation]
    assert sorted(foreign) == ["duplicate_of_id", "job_id", "owner_id", "source_id"]
    assert set(foreign) <= leading
    prefixes = [(a, b) for a, ca in indexes.items() for b, cb in indexes.items()
                if a != b and len(ca) < len(cb) and cb[:len(ca)] == ca]
    # a unique constraint's columns may repeat a plain index's: it holds a rule, not a look-up
    assert [(a, b) for a, b in prefixes if not found[a][1]] == []
    assert ["owner_id"] not in indexes.values() and ["job_id"] not in indexes.values()

