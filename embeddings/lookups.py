"""``field__any_of=[...]``: membership in a list, as ``IN`` does, written for PostgreSQL as
``field = ANY(%s)`` with the whole list as one array parameter.

Why: psycopg splits and quotes a query's text in Python once per placeholder and caches only short
queries, and the ORM builds one expression per value; a vectors-worker chunk names hundreds of ids
per statement, so an ``IN (%s, %s, ...)`` list cost more Python than the statement cost the
database (docs/scaling.md, "The vectors writer and the bounds"). Other backends compile it as ``__in``.
"""
from __future__ import annotations

from collections.abc import Iterable

from django.core.exceptions import EmptyResultSet
from django.db.models import Field
from django.db.models.lookups import In


@Field.register_lookup
class AnyOf(In):
    """``lhs = ANY(array)`` on PostgreSQL for a list of values (``None`` dropped, as ``IN`` does;
    an empty list matches nothing); a subquery or another backend: ``IN``."""

    lookup_name = "any_of"

    def as_postgresql(self, compiler, connection):
        if not self.rhs_is_direct_value():
            return super().as_sql(compiler, connection)
        lhs, lhs_params = self.process_lhs(compiler, connection)
        field = self.lhs.output_field
        values = list(dict.fromkeys(v for v in self.rhs if v is not None))
        if not values:
            raise EmptyResultSet
        return f"{lhs} = ANY(%s)", (*lhs_params, [field.get_db_prep_value(v, connection, prepared=True)
                                                  for v in values])


def pg_array(values: Iterable[str | int | None]) -> str:
    """A PostgreSQL array literal (``'{"a","b",NULL}'``) of ``values`` (text quoted, numbers as
    ``str`` writes them, ``None`` as ``NULL``), to be passed as one text parameter and cast in the
    SQL (``%s::uuid[]``).

    Why: psycopg dumps a list parameter element by element in Python (a regular expression per
    element to decide its quoting); a chunk's statements carry lists of 512 ids, where this costs
    one join."""
    return "{" + ",".join("NULL" if v is None else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
                          if isinstance(v, str) else str(v) for v in values) + "}"
