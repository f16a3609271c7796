"""Cursor pagination whose cursor is checked whole: what it encodes and the position it carries.

DRF's ``CursorPagination`` refuses a cursor that is not base64 or whose offset and direction are
not numbers (404 ``not_found``), but passes the position (``p``, the ordering field's value of the
row a page starts after) to the database unchecked: ``p=abc``, a date that does not exist, a NUL or
a time the database cannot hold became a 500. Here a position is read as the ordering field reads
it, and one the field, Python or the database cannot take is the same 404 as an unknown cursor.
"""
from __future__ import annotations

import datetime

from django.core.exceptions import ValidationError
from django.db import connections
from rest_framework.exceptions import NotFound
from rest_framework.pagination import CursorPagination


class CheckedCursorPagination(CursorPagination):
    """``CursorPagination`` that refuses a cursor whose position the ordering field cannot hold.

    Raises:
        NotFound: ``not_found`` (404, DRF's "Invalid cursor") for any cursor this service did not
            write: undecodable, or a position that is not a value of the ordering field (a
            date-time without its UTC offset included: every cursor written here carries one).
    """

    def paginate_queryset(self, queryset, request, view=None):
        self._queryset = queryset  # decode_cursor (called by DRF from here) checks against its field
        return super().paginate_queryset(queryset, request, view)

    def decode_cursor(self, request):
        cursor = super().decode_cursor(request)
        if cursor is None or cursor.position is None:
            return cursor
        queryset = self._queryset
        field = queryset.model._meta.get_field(self.ordering[0].lstrip("-"))
        try:
            value = field.to_python(cursor.position)
            if isinstance(value, datetime.datetime):
                if value.tzinfo is None:
                    raise ValueError("a position without its UTC offset")
                value.astimezone(datetime.UTC)  # OverflowError: 0001-01-01 00:00+14:00
            # what the database adapter does with it (SQLite converts a date-time to UTC)
            field.get_db_prep_value(value, connections[queryset.db], prepared=False)
        except (ValidationError, ValueError, TypeError, OverflowError):
            raise NotFound(self.invalid_cursor_message) from None
        return cursor


class NewestFirst(CheckedCursorPagination):
    """Lists newest first, ``page_size`` (100) per page; ``next`` / ``previous`` are URLs with an
    opaque ``cursor`` (stable while new rows arrive; a cursor that is not one: 404 ``not_found``)."""

    ordering = ("-created_at", "-id")
    page_size = 100
