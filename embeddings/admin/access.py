"""The admin of API keys and usage counters (issue 55; docs/api-keys.md, docs/usage.md)."""
from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import Q
from django.utils import timezone

from embeddings.models import LIMIT_SETTINGS, ApiKey, UsageRecord
from embeddings.services.access import keys as key_services

from .base import CheckedActionsMixin


# --- API keys (issue 55, docs/api-keys.md) ------------------------------------------------------------
# Made through the API, the site or `manage.py apikeys` (the secret is shown there, once); here staff
# revoke keys and set their limits. Never deleted: a revoked row still names who made what.

class KeyStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request, model_admin):
        return [("active", "active"), ("revoked", "revoked"), ("expired", "expired")]

    def queryset(self, request, queryset):
        now = timezone.now()
        live = Q(revoked_at__isnull=True) & (Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        if self.value() == "active":
            return queryset.filter(live)
        if self.value() == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        if self.value() == "expired":
            return queryset.filter(revoked_at__isnull=True, expires_at__lte=now)
        return queryset


@admin.register(ApiKey)
class ApiKeyAdmin(CheckedActionsMixin, admin.ModelAdmin):
    list_display = ("prefix", "name", "owner", "state", "scope_list", "created_at", "last_used_at", "expires_at",
                    "revoked_at")
    list_filter = (KeyStateFilter,)
    search_fields = ("prefix", "name", "owner__username")
    fields = ("prefix", "name", "owner", "scopes", "created_at", "expires_at", "last_used_at", "revoked_at",
              *LIMIT_SETTINGS, "bulk_weight")
    readonly_fields = ("prefix", "owner", "scopes", "created_at", "last_used_at", "revoked_at")
    actions = ("revoke",)

    @admin.display(description="state")
    def state(self, key: ApiKey) -> str:
        return key.state()

    @admin.display(description="scopes")
    def scope_list(self, key: ApiKey) -> str:
        return ", ".join(key.scopes)

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request, queryset):
        for key in queryset:
            key_services.key_revoke(key=key)
        self.message_user(request, f"{queryset.count()} keys revoked.", messages.SUCCESS)

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(UsageRecord)
class UsageRecordAdmin(CheckedActionsMixin, admin.ModelAdmin):
    """Usage counter rows (docs/usage.md), read-only: they are written only by metering, in the
    transaction of the work they count (deleting one, or its owner, takes that usage out of every
    report). Filters: kind, model, key prefix; search: owner, key prefix; newest day first."""

    list_display = ("day", "owner", "key_prefix", "model_id", "kind", "units", "bytes", "compute_s")
    # no date filter: the admin's date lookups turn a huge year in the query string into a 500
    list_filter = ("kind", "model_id", "key_prefix")
    search_fields = ("owner__username", "key_prefix")
    fields = list_display
    readonly_fields = fields
    list_select_related = ("owner",)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
