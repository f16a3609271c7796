"""What every ``ModelAdmin`` of the service shares: refusing tampered action selections, read-only inlines."""
from __future__ import annotations

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import ValidationError


class CheckedActionsMixin:
    """A ``ModelAdmin`` whose list actions refuse selected ids that are not keys of the model (a
    tampered form: ``_selected_action=junk`` on a uuid or integer key, an integer past the database's
    range), with a message and the list again; Django's admin filters by them as they are, and the
    key field raises ``ValidationError`` or the database driver ``OverflowError`` (a 500). An empty
    ``?_to_field=`` on an object's page names the primary key, as when it is absent."""

    def get_object(self, request, object_id, from_field=None):
        # Django checks a non-empty _to_field (to_field_allowed: 400) but passes "" on to
        # _meta.get_field(""), which raises FieldDoesNotExist (a 500)
        return super().get_object(request, object_id, from_field or None)

    def response_action(self, request, queryset):
        try:
            for pk in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
                self.model._meta.pk.clean(pk, None)  # type, then the range validators of the database
        except ValidationError:
            self.message_user(request, "The selection holds ids that are not this list's: nothing was changed.",
                              messages.ERROR)
            return None  # the admin shows the list again
        return super().response_action(request, queryset)


class ReadOnlyInline(admin.TabularInline):
    """A table of rows shown under their parent, none added, changed or deleted here: ``fields`` read-only."""

    extra = 0
    can_delete = False

    def get_readonly_fields(self, request, obj=None):
        return self.fields

    def has_add_permission(self, request, obj=None):
        return False
