"""Django admin: jobs with progress and failures, images with status, reason and thumbnail, and an
action that retries failed images; near-duplicate scans and groups, read-only. Deleting (one object
or "delete selected") goes through the services, so points, blobs and duplicates are settled as for
the API (``image_deleted``). OpenAI files and batches, read-only, linked to each other and to the
batch's job; a file is deleted and a batch cancelled through their services. API keys and usage
counter rows: ``embeddings.admin.access``; what every admin here shares: ``embeddings.admin.base``."""
from __future__ import annotations

import json
import unicodedata

from django.contrib import admin, messages
from django.contrib.auth import admin as auth_admin
from django.contrib.auth.models import Group, User
from django.contrib.contenttypes.views import shortcut
from django.core.exceptions import ValidationError
from django.db.models import Count, Q
from django.http import Http404
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join

from embeddings.errors import ApplicationError
from embeddings.models import (
    Batch,
    BatchFile,
    BatchPart,
    BatchStat,
    DuplicateGroup,
    DuplicateMember,
    DuplicateScan,
    EmbeddingSpace,
    Image,
    ImageStatus,
    Job,
    JobKind,
    JobStatus,
    NotDuplicate,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
)
from embeddings.services.batches import batches as batch_services
from embeddings.services.batches import files as file_services
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.catalogue.images import image_delete, images_delete
from embeddings.services.catalogue.jobs import images_retry
from embeddings.services.lifecycle import model_migrations as migrations
from embeddings.services.webhooks import delivery as webhook_delivery
from embeddings.site.thumbnails import thumbnail_response

from . import access  # noqa: F401 - API keys and usage (issue 55), registered on import
from .base import CheckedActionsMixin, ReadOnlyInline


def view_on_site(request, content_type_id, object_id):
    """``/admin/r/<content type id>/<object id>/``: Django's "view on site" redirect
    (``contenttypes.views.shortcut``), with a 404 for an id the model's key cannot hold: Django
    catches the ``ValueError`` of an integer key, not the ``ValidationError`` of a uuid key (a 500).
    Mounted before the admin's own by ``project.urls``, behind ``admin.site.admin_view`` as it is."""

    try:
        return shortcut(request, content_type_id, object_id)
    except ValidationError:
        raise Http404(f"no object {object_id!r} of content type {content_type_id}") from None


admin.site.unregister(User)
admin.site.unregister(Group)


@admin.register(User)
class UserAdmin(CheckedActionsMixin, auth_admin.UserAdmin):
    pass


@admin.register(Group)
class GroupAdmin(CheckedActionsMixin, auth_admin.GroupAdmin):
    pass


class ImageInline(admin.TabularInline):
    model = Image
    fields = ("original_name", "status", "reason", "reason_detail")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True
    verbose_name_plural = "failed images"

    def get_queryset(self, request):
        return super().get_queryset(request).filter(status=ImageStatus.FAILED)

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Job)
class JobAdmin(CheckedActionsMixin, admin.ModelAdmin):
    list_display = ("__str__", "owner", "kind", "status", "priority", "progress", "total", "created_at", "finished_at")
    list_filter = ("kind", "status", "priority")
    readonly_fields = ("id", "model_id", "total", "created_at", "started_at", "finished_at", "progress", "timings",
                       "source", "reading", "batch_link")
    inlines = (ImageInline,)
    actions = ("pause", "resume", "cancel")

    @admin.display(description="progress")
    def progress(self, job: Job) -> str:
        p = job_services.job_counts(job)
        return (f"{p['embedded']} embedded, {p['skipped']} skipped, {p['failed']} failed, "
                f"{p['queued']} queued of {job.total}")

    @admin.display(description="stage timings (ms per batch)")
    def timings(self, job: Job) -> str:
        rows = job_services.stage_summary(BatchStat.objects.filter(job=job))
        return format_html(
            "<table><tr><th>stage</th><th>min</th><th>avg</th><th>max</th><th>p95</th></tr>{}</table>",
            format_html_join("", "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                             ((s, v["min"], v["avg"], v["max"], v["p95"]) for s, v in rows.items())),
        )

    @admin.display(description="OpenAI batch")
    def batch_link(self, job: Job) -> str:
        """A link to the batch this job runs (kind ``batch``), or ``-`` (not named as the reverse
        accessor ``Job.openai_batch``, which the admin would show as text)."""
        batch = Batch.objects.filter(job=job).only("id").first()
        return _link(batch) if batch else "-"

    def _transition(self, request, queryset, to):
        for job in queryset:
            if job.kind == JobKind.BATCH:  # its state follows its batch's: cancel the batch instead
                self.message_user(request, f"{job}: runs an OpenAI batch; cancel the batch instead", messages.WARNING)
                continue
            try:
                job_services.job_transition(job=job, to=to)
            except Exception as e:  # ApplicationError: show, continue with the others
                self.message_user(request, f"{job}: {e}", messages.WARNING)

    @admin.action(description="Pause selected jobs")
    def pause(self, request, queryset):
        self._transition(request, queryset, JobStatus.PAUSED)

    @admin.action(description="Resume selected jobs")
    def resume(self, request, queryset):
        self._transition(request, queryset, JobStatus.QUEUED)

    @admin.action(description="Cancel selected jobs")
    def cancel(self, request, queryset):
        self._transition(request, queryset, JobStatus.CANCELLED)

    def delete_model(self, request, obj):
        job_services.job_delete(job=obj)

    def delete_queryset(self, request, queryset):
        for job in queryset:
            job_services.job_delete(job=job)


@admin.register(Image)
class ImageAdmin(CheckedActionsMixin, admin.ModelAdmin):
    list_display = ("thumbnail", "original_name", "external_id", "owner", "status", "reason", "lane", "width", "height",
                    "created_at")
    list_filter = ("status", "reason", "lane")
    # the caller's id and the URL or object it came from find an image too (issue 41)
    search_fields = ("original_name", "sha256", "id", "external_id", "origin")
    readonly_fields = [f.name for f in Image._meta.fields] + ["thumbnail"]
    actions = ("retry_failed",)

    def get_search_results(self, request, queryset, search_term):
        """The search as typed, or with the term in NFC: ids are stored in NFC
        (``metadata.normal_external_id``), so either spelling of one finds it."""
        found, duplicates = super().get_search_results(request, queryset, search_term)
        normal = unicodedata.normalize("NFC", search_term)
        if normal != search_term:
            also, more = super().get_search_results(request, queryset, normal)
            found, duplicates = found | also, duplicates or more
        return found, duplicates

    def get_urls(self):
        return [path("<uuid:image_id>/thumbnail/", self.admin_site.admin_view(self.thumbnail_view),
                     name="embeddings_image_thumbnail")] + super().get_urls()

    @admin.display(description="thumbnail")
    def thumbnail(self, im: Image) -> str:
        if im.status not in (ImageStatus.EMBEDDED, ImageStatus.SKIPPED):  # never decoded: no thumbnail
            return "—"
        url = reverse("admin:embeddings_image_thumbnail", args=[im.id])
        return format_html('<img src="{}" style="max-height:64px;max-width:96px" loading="lazy">', url)

    def thumbnail_view(self, request, image_id):
        """The WebP thumbnail the decoding worker drew (``embeddings.site.thumbnails``), with its
        cache headers; 404 when the image has none. The web process never decodes an original."""

        im = Image.objects.filter(id=image_id).first()
        if im is None:
            raise Http404
        try:
            return thumbnail_response(request, im)
        except ApplicationError as e:
            raise Http404(str(e)) from e

    @admin.action(description="Retry selected failed images")
    def retry_failed(self, request, queryset):
        n = images_retry(images=queryset.filter(status=ImageStatus.FAILED))
        self.message_user(request, f"{n} image(s) queued again")

    def has_add_permission(self, request):
        return False

    def delete_model(self, request, obj):
        image_delete(image=obj)

    def delete_queryset(self, request, queryset):
        images_delete(images=queryset)


@admin.register(BatchStat)
class BatchStatAdmin(CheckedActionsMixin, admin.ModelAdmin):
    list_display = ("created_at", "lane", "job", "images", "failed", "decode_ms", "preprocess_ms", "embed_ms",
                    "upsert_ms", "total_ms")
    list_filter = ("lane",)


@admin.register(EmbeddingSpace)
class EmbeddingSpaceAdmin(CheckedActionsMixin, admin.ModelAdmin):
    """Embedding spaces (issue 13, docs/operations.md "Changing the model"): promote (through the
    quality gate), roll back, drop. Started from the API or ``manage.py model_migration start``."""

    list_display = ("model_id", "state", "dim", "collection", "job", "promoted_at", "demoted_at", "dropped_at")
    list_filter = ("state",)
    readonly_fields = [f.name for f in EmbeddingSpace._meta.fields]
    actions = ("promote", "promote_forced", "rollback", "drop")

    def _each(self, request, queryset, act) -> None:

        for space in queryset:
            try:
                act(space)
                self.message_user(request, f"{space.model_id}: done")
            except ApplicationError as e:
                self.message_user(request, f"{space.model_id}: {e.code}: {e}", messages.WARNING)

    @admin.action(description="Promote (the quality gate must pass)")
    def promote(self, request, queryset):

        self._each(request, queryset, lambda s: migrations.promote(s, by=request.user.get_username()))

    @admin.action(description="Promote past the quality gate (force; recorded)")
    def promote_forced(self, request, queryset):

        self._each(request, queryset, lambda s: migrations.promote(s, force=True, by=request.user.get_username()))

    @admin.action(description="Roll back to the standby that was active before")
    def rollback(self, request, queryset):

        # whichever rows are selected: a rollback leaves the active space for the latest standby
        self._each(request, EmbeddingSpace.objects.filter(state="active"),
                   lambda s: migrations.rollback(by=request.user.get_username()))

    @admin.action(description="Drop (delete the collection and the copies; not the active space)")
    def drop(self, request, queryset):

        self._each(request, queryset, migrations.space_drop)

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


# --- webhooks (issue 42, docs/webhooks.md) ---------------------------------------------------------
# Endpoints without their secrets (shown once, by the API); deliveries and attempts read-only.

class WebhookAttemptInline(ReadOnlyInline):
    model = WebhookAttempt
    fields = ("number", "started_at", "duration_ms", "status_code", "reason", "error")


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(CheckedActionsMixin, admin.ModelAdmin):
    list_display = ("url", "owner", "job", "active", "events", "description", "created_at")
    list_filter = ("active",)
    search_fields = ("url", "description", "owner__username")
    fields = ("url", "owner", "job", "events", "active", "description", "created_at")
    readonly_fields = ("url", "owner", "job", "created_at")  # a URL is checked by the API

    def has_add_permission(self, request):
        return False  # made through the API, which shows the secret once


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(CheckedActionsMixin, admin.ModelAdmin):
    # one row fits a laptop's width: the last answer is one column (a status code, or a reason)
    list_display = ("message_id", "event", "endpoint", "status", "attempts", "last_answer", "next_attempt_at")
    list_filter = ("status", "event", "last_reason")
    search_fields = ("message_id", "key", "endpoint__url")
    fields = ("message_id", "event", "key", "endpoint", "status", "attempts", "next_attempt_at", "last_status_code",
              "last_reason", "last_error", "delivered_at", "created_at", "payload")
    readonly_fields = fields
    inlines = (WebhookAttemptInline,)
    actions = ("redeliver",)

    @admin.display(description="last answer")
    def last_answer(self, obj) -> str:
        """The last attempt's HTTP status, or its reason code when none came (timeout, refused)."""
        return str(obj.last_status_code) if obj.last_status_code else (obj.last_reason or "-")

    @admin.action(description="Send again from the first attempt (same webhook-id)")
    def redeliver(self, request, queryset):
        for delivery in queryset:
            webhook_delivery.delivery_redeliver(delivery=delivery)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False



# --- near-duplicate groups (issue 45, embeddings/services/duplicates/) ------------------------------
# Read-only: groups are reviewed on the site or through the API, whose services delete the other
# images with their points, blobs and thumbnails. Deleting a "not duplicates" row here lets a later
# scan group those two pictures again.

@admin.register(DuplicateScan)
class DuplicateScanAdmin(CheckedActionsMixin, admin.ModelAdmin):
    list_display = ("owner", "model_id", "state", "threshold", "groups", "scanned", "finished_at")
    list_filter = ("state", "model_id")
    search_fields = ("owner__username",)
    fields = ("owner", "model_id", "state", "threshold", "calibration_report", "scanned", "edges", "groups", "error",
              "started_at", "finished_at", "duration_s", "query_s")
    readonly_fields = fields

    @admin.display(description="calibration")
    def calibration_report(self, scan: DuplicateScan) -> str:
        """The calibration's report as indented JSON (``workers.duplicates.calibrate``)."""
        return format_html("<pre>{}</pre>", json.dumps(scan.calibration, indent=2, sort_keys=True))

    def has_add_permission(self, request):
        return False  # started by the site's button or the API (``scan_start``)


class DuplicateMemberInline(ReadOnlyInline):
    model = DuplicateMember
    fields = ("thumbnail", "image", "score", "representative", "point_id")

    @admin.display(description="thumbnail")
    def thumbnail(self, m: DuplicateMember) -> str:
        url = reverse("admin:embeddings_image_thumbnail", args=[m.image_id])
        return format_html('<img src="{}" style="max-height:64px;max-width:96px" loading="lazy">', url)


@admin.register(DuplicateGroup)
class DuplicateGroupAdmin(CheckedActionsMixin, admin.ModelAdmin):
    list_display = ("id", "owner", "kind", "status", "size", "threshold", "created_at")
    list_filter = ("kind", "status")
    search_fields = ("owner__username", "id")
    fields = ("id", "owner", "model_id", "kind", "status", "threshold", "kept", "created_at", "reviewed_at")
    readonly_fields = fields
    inlines = (DuplicateMemberInline,)

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("owner").annotate(member_count=Count("members"))

    @admin.display(description="size", ordering="member_count")
    def size(self, group: DuplicateGroup) -> int:
        return group.member_count

    def has_add_permission(self, request):
        return False


@admin.register(NotDuplicate)
class NotDuplicateAdmin(CheckedActionsMixin, admin.ModelAdmin):
    list_display = ("owner", "sha_a", "sha_b", "created_at")
    search_fields = ("owner__username", "sha_a", "sha_b")
    readonly_fields = ("owner", "sha_a", "sha_b", "created_at")

    def has_add_permission(self, request):
        return False  # said by a person on a group ("not duplicates")


# --- OpenAI files and batches (issue 56, docs/batch-api.md) -----------------------------------------
# Read-only: a batch's state, counts and files are the workers' (a change here would lose or repeat
# lines); a batch is cancelled and a file deleted through their services, as the API does.

def _link(obj) -> str:
    """A link to ``obj``'s admin page, labelled with its id."""
    if obj is None:
        return "-"
    url = reverse(f"admin:{obj._meta.app_label}_{obj._meta.model_name}_change", args=[obj.pk])
    return format_html('<a href="{}">{}</a>', url, obj.pk)


@admin.register(BatchFile)
class BatchFileAdmin(CheckedActionsMixin, admin.ModelAdmin):
    list_display = ("id", "owner", "purpose", "filename", "bytes", "lines", "created_at")
    list_filter = ("purpose",)
    search_fields = ("id", "filename", "owner__username")
    fields = ("id", "owner", "purpose", "filename", "bytes", "lines", "storage_key", "sha256", "created_at", "batches")
    readonly_fields = fields

    @admin.display(description="batches")
    def batches(self, f: BatchFile) -> str:
        """The batches that read this file or wrote it."""
        rows = Batch.objects.filter(Q(input_file=f) | Q(output_file=f) | Q(error_file=f)).only("id")
        return format_html_join(", ", "{}", ((_link(b),) for b in rows)) or "-"

    def has_add_permission(self, request):
        return False  # uploaded through the API (``POST /v1/files``), whose limits and checks apply

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return True  # as ``DELETE /v1/files/{id}``: a running batch keeps reading its input

    def delete_model(self, request, obj):
        file_services.file_delete(file=obj)

    def delete_queryset(self, request, queryset):
        for f in queryset:
            file_services.file_delete(file=f)


class BatchPartInline(ReadOnlyInline):
    model = BatchPart
    fields = ("index", "state", "first_line", "lines", "completed", "failed", "leased_at")


@admin.register(Batch)
class BatchAdmin(CheckedActionsMixin, admin.ModelAdmin):
    list_display = ("id", "owner", "status", "counts", "completion_window", "created_at", "expires_at")
    list_filter = ("status",)
    search_fields = ("id", "owner__username", "input_file_name")
    fields = ("id", "owner", "status", "counts", "job_link", "input_file_link", "output_file_link", "error_file_link",
              "endpoint", "model_id", "completion_window", "metadata", "errors", "created_at", "expires_at",
              "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
              "cancelled_at")
    readonly_fields = fields
    inlines = (BatchPartInline,)
    actions = ("cancel",)

    @admin.display(description="request counts")
    def counts(self, batch: Batch) -> str:
        c = batch_services.request_counts(batch)
        return f"{c['completed']} completed, {c['failed']} failed of {c['total']}"

    @admin.display(description="job")
    def job_link(self, batch: Batch) -> str:
        return _link(batch.job)

    @admin.display(description="input file")
    def input_file_link(self, batch: Batch) -> str:
        return _link(batch.input_file) if batch.input_file_id else f"{batch.input_file_name} (deleted)"

    @admin.display(description="output file")
    def output_file_link(self, batch: Batch) -> str:
        return _link(batch.output_file)

    @admin.display(description="error file")
    def error_file_link(self, batch: Batch) -> str:
        return _link(batch.error_file)

    @admin.action(description="Cancel selected batches")
    def cancel(self, request, queryset):
        for batch in queryset:
            try:
                batch_services.batch_cancel(batch=batch)
            except ApplicationError as e:  # ended, finalising or cancelling already: show, go on
                self.message_user(request, f"{batch}: {e}", messages.WARNING)

    def has_add_permission(self, request):
        return False  # made through the API (``POST /v1/batches``), which validates its file

    def has_change_permission(self, request, obj=None):
        return False
