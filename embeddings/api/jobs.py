"""``/api/jobs/``: bulk jobs from files, zips, (staff) a server folder, or a catalogue read by the
fetch worker (a manifest or a bucket prefix); their progress, and pause / resume / cancel."""
from __future__ import annotations

from django.conf import settings
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.generics import GenericAPIView
from rest_framework.parsers import FormParser
from rest_framework.response import Response
from rest_framework.views import APIView

from embeddings.api.access import bulk_job
from embeddings.api.catalogue_fields import with_identities
from embeddings.api.form_input import FormSerializer
from embeddings.api.pagination import NewestFirst
from embeddings.api.parsers import DrfMultiPartParser as MultiPartParser
from embeddings.api.parsers import JSONParser
from embeddings.api.request_body import check_parts, parsed, uploaded_files
from embeddings.api.schema import errors
from embeddings.api.webhook_fields import (
    CallbackUrlsField,
    WebhookCreatedSerializer,
    WebhookSerializer,
)
from embeddings.errors import ApplicationError
from embeddings.models import Job, JobPriority, WebhookEvent
from embeddings.selectors import jobs_visible_to
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.catalogue import reading
from embeddings.services.catalogue.sources import from_folder, from_uploads, from_zip
from embeddings.services.webhooks import endpoints as webhook_services
from embeddings.services.usage.keys import key_prefix_of


class JobCreateSerializer(FormSerializer):
    """Fields of ``POST /api/jobs/`` besides the files / zip / manifest file."""

    name = serializers.CharField(required=False, allow_blank=True, max_length=200, default="")
    priority = serializers.ChoiceField(choices=JobPriority.choices, default=JobPriority.BACKGROUND)
    deadline = serializers.DateTimeField(required=False, allow_null=True, default=None)
    folder = serializers.CharField(required=False, help_text="server-side folder (staff only)")
    manifest_key = serializers.CharField(
        required=False, max_length=2048,
        help_text="a manifest (CSV, JSON Lines or Parquet) in object storage: s3://bucket/key of a bucket in "
                  "SOURCE_BUCKETS; one row per image: url or key, optional external_id, other columns metadata")
    prefix = serializers.CharField(required=False, max_length=2048,
                                   help_text="every object under s3://bucket/prefix (a bucket in SOURCE_BUCKETS)")
    extensions = serializers.CharField(required=False, max_length=256,
                                       help_text="with prefix: only these name endings, comma-separated (jpg,png)")
    bucket = serializers.CharField(required=False, max_length=2048,
                                   help_text="s3://bucket that a manifest's bare `key` values name objects of "
                                             "(default: the manifest's own bucket)")
    # webhooks (issue 42, docs/webhooks.md): the job's own endpoints
    callback_url = CallbackUrlsField(required=False, help_text="URL(s) that receive this job's events, signed "
                                     "(Standard Webhooks); each one's secret is in the answer's `webhooks`, once")
    callback_events = serializers.ListField(child=serializers.ChoiceField(choices=WebhookEvent.choices),
                                            required=False, max_length=len(WebhookEvent.choices),
                                            help_text="event types the callback URLs receive (default: all)")


class JobSubmitSerializer(JobCreateSerializer):
    """``POST /api/jobs/`` (multipart): image files, zip archives, or (staff) a server folder; at
    least one of the three."""

    files = serializers.ListField(
        child=serializers.FileField(), required=False, max_length=settings.DATA_UPLOAD_MAX_NUMBER_FILES,
        help_text=f"image files (at most UPLOAD_MAX_FILES = {settings.DATA_UPLOAD_MAX_NUMBER_FILES} parts)")
    zip = serializers.ListField(
        child=serializers.FileField(), required=False, max_length=settings.DATA_UPLOAD_MAX_NUMBER_FILES,
        help_text=f"zip archives of images (at most ZIP_MAX_ENTRIES = {settings.ZIP_MAX_ENTRIES} entries each)")
    manifest = serializers.FileField(required=False, help_text="a manifest (CSV, JSON Lines or Parquet): one row "
                                     "per image, url or key, optional external_id, other columns metadata")
    external_id = serializers.CharField(max_length=256, allow_blank=True, required=False,
                                        help_text="with files: your id of the file; one part per file, in order, "
                                                  "for several (\"\": that file has none); not starting with { or [")
    metadata = serializers.DictField(required=False,
                                     help_text="with files: a JSON object for every file (its JSON text); repeat the "
                                               "part once per file, in order, to give each its own")


class JobSerializer(serializers.ModelSerializer):
    """Read-only job representation (progress is added by the view)."""

    class Meta:
        model = Job
        fields = ("id", "name", "kind", "status", "priority", "deadline", "model_id", "chunk_size", "total",
                  "created_at", "started_at", "finished_at", "source", "reading")
        read_only_fields = fields
        extra_kwargs = {"source": {"help_text": "a manifest or prefix job's source: kind, format, key or uri, "
                                                "rows_read, and error (code, message) when it could not be read"},
                        "reading": {"help_text": "its manifest or prefix is still being read: total still grows"}}


class RenamedSerializer(serializers.Serializer):
    """A file whose name was replaced (``upload-N`` / ``entry-N``), with the name as sent."""

    name = serializers.CharField()
    raw_name = serializers.CharField(allow_blank=True)


class JobCreatedSerializer(serializers.Serializer):
    """``POST /api/jobs/`` (202): follow ``url``."""

    id = serializers.UUIDField()
    total = serializers.IntegerField(min_value=0, help_text="images so far (0 for a manifest or prefix: it grows "
                                                             "while `reading`)")
    url = serializers.CharField()
    renamed = RenamedSerializer(many=True, help_text="files whose name was replaced")
    reading = serializers.BooleanField(required=False, help_text="a manifest or prefix job: read by the fetch worker")
    webhooks = WebhookCreatedSerializer(many=True, required=False,
                                        help_text="the job's own webhook endpoints (`callback_url`), with their "
                                                  "secrets: shown this once")


class FailureSerializer(serializers.Serializer):
    """A failed image of a job, with its reason code (``workers/errors.py``)."""

    id = serializers.UUIDField()
    original_name = serializers.CharField(allow_blank=True)
    reason = serializers.CharField(allow_blank=True)
    reason_detail = serializers.CharField(allow_blank=True)
    row = serializers.IntegerField(allow_null=True, help_text="its manifest row, when a manifest made it")
    origin = serializers.CharField(allow_blank=True, help_text="the URL or object it was fetched from")


class JobLaneSerializer(serializers.Serializer):
    """A job's place in the bulk lane (``services.catalogue.jobs.job_lane``)."""

    position = serializers.IntegerField(help_text="jobs of the lane expected to finish before it")
    jobs = serializers.IntegerField(help_text="jobs in the lane (with a chunk waiting or in flight)")
    share = serializers.FloatField(help_text="its fraction of the lane's images/s now (0 while urgent work goes first)")
    eta = serializers.DateTimeField(allow_null=True, help_text="when its last image is done in the lane's order; "
                                    "null before the lane has a rate")
    at_risk = serializers.BooleanField(help_text="it has a deadline and this ETA is past it")
    infeasible = serializers.BooleanField(help_text="its deadline cannot be met even served first: it keeps its "
                                          "fair share")
    rate_images_per_s = serializers.FloatField(allow_null=True, help_text="the lane's images/s the ETA assumes")


class JobProgressSerializer(JobSerializer):
    """``GET /api/jobs/{id}/`` (``services.jobs.job_progress``)."""

    counts = serializers.DictField(child=serializers.IntegerField(), help_text="images per status")
    embedded = serializers.IntegerField()
    skipped = serializers.IntegerField()
    failed = serializers.IntegerField()
    finished = serializers.IntegerField(help_text="images in a final status (settled or cancelled)")
    elapsed_s = serializers.FloatField(help_text="s since the job started, until now or until it finished")
    throughput_images_per_s = serializers.FloatField(
        allow_null=True, help_text="settled images (embedded, skipped, failed, expired) / elapsed_s; null before "
        "one settled (docs/catalogues.md, \"A job's progress\")")
    eta = serializers.DateTimeField(allow_null=True, help_text="now + queued images / throughput; null with "
                                    "nothing queued or no rate yet")
    at_risk = serializers.BooleanField(help_text="a deadline, images queued, and the ETA past it (with no rate "
                                       "yet: when even one image per the seconds waited would miss it)")
    lane = JobLaneSerializer(allow_null=True, help_text="its place in the bulk lane under the fair scheduler "
                             "(`BULK_SCHEDULER=fair`; docs/lanes.md, \"The bulk lane's order\"): then `eta` and `at_risk` "
                             "follow the lane's order over the other jobs; null under `fifo` or with no chunk waiting "
                             "or in flight")
    failures = FailureSerializer(many=True)
    failure_reasons = serializers.DictField(child=serializers.IntegerField(),
                                            help_text="failed images per reason code (fetch_timeout, not_an_image, ...)")
    timings_ms = serializers.DictField(help_text="per stage: min / avg / max / p95 / per_image_avg, ms")
    batches = serializers.IntegerField()
    utilisation = serializers.DictField(help_text="CPU % / GPU % / GPU MiB while its chunks ran")
    pipeline = serializers.DictField(help_text="the settings it ran with")
    webhooks = WebhookSerializer(many=True, required=False, help_text="the job's own webhook endpoints "
                                 "(`callback_url`; account endpoints hear it too: `GET /api/webhooks/`)")

    class Meta(JobSerializer.Meta):
        fields = JobSerializer.Meta.fields + (
            "counts", "embedded", "skipped", "failed", "finished", "elapsed_s", "throughput_images_per_s", "eta",
            "at_risk", "lane", "failures", "failure_reasons", "timings_ms", "batches", "utilisation", "pipeline", "webhooks")
        read_only_fields = fields


def _callbacks_shown(callbacks: list) -> dict:
    """A new job's own webhook endpoints with their secrets (shown this once), when it has some."""
    return {"webhooks": WebhookCreatedSerializer(callbacks, many=True).data} if callbacks else {}


def _renamed(sources) -> list[dict]:
    """``[{"name", "raw_name"}]`` of the sources whose display name is not the name sent."""
    return [{"name": s.name, "raw_name": s.raw_name} for s in sources if s.raw_name is not None]


class JobListView(GenericAPIView):
    """``POST /api/jobs/``: a bulk job from files, a zip, or (staff) a server folder; ``GET``: jobs."""

    required_scope = {"GET": "jobs:read", "POST": "jobs:write"}

    parser_classes = (MultiPartParser, FormParser, JSONParser)
    pagination_class = NewestFirst
    serializer_class = JobSerializer

    @extend_schema(
        operation_id="jobs_create",
        request={"multipart/form-data": JobSubmitSerializer, "application/json": JobCreateSerializer},
        description="A bulk job from image files, zip archives, (staff only) a server folder under "
                    "INGEST_ROOTS, or a catalogue where it lives: a manifest (uploaded, or `manifest_key` in an "
                    "allowed bucket) of image URLs or object keys with your ids and metadata, or every object "
                    "under a `prefix`. A manifest or prefix is read by the fetch worker: the job answers at once "
                    "and its `total` grows while `reading`. Never refused for load. Follow `url` for progress.",
        responses={202: JobCreatedSerializer, **errors(400, 403, 413, 415)})
    def post(self, request):
        data, files = parsed(request)
        check_parts(data, files, file_fields=("files", "file", "zip", "manifest"))
        s = JobCreateSerializer(data=data)
        s.is_valid(raise_exception=True)
        v = s.validated_data
        # webhooks (issue 42): the job's callback URLs are checked before any job exists
        v["callbacks"] = webhook_services.job_callbacks_prepare(owner=request.user, urls=v.get("callback_url") or [],
                                                                events=v.get("callback_events"))
        manifests = uploaded_files(files, "manifest")
        remote = len(manifests) + bool(v.get("manifest_key")) + bool(v.get("prefix"))
        if remote:
            if remote > 1 or uploaded_files(files, "files", "file", "zip") or v.get("folder"):
                raise ApplicationError("a job reads one source: files and zips, a folder, a manifest, a manifest_key "
                                       "or a prefix", code="mixed_sources")
            with bulk_job(request, 0) as made:  # the rows are not known yet: admitted under the day's limit
                response = self._remote(request.user, v, manifests[0] if manifests else None,
                                        key_prefix_of(request))
                made(response.data["id"])
            return response
        sources = with_identities(data, from_uploads(uploaded_files(files, "files", "file")))
        for archive in uploaded_files(files, "zip"):
            sources += from_zip(archive, max_entries=settings.ZIP_MAX_ENTRIES,
                                max_uncompressed=settings.ZIP_MAX_UNCOMPRESSED_BYTES,
                                max_ratio=settings.ZIP_MAX_RATIO, max_entry_bytes=settings.PIPELINE.max_image_bytes)
        if v.get("folder"):
            if not request.user.is_staff:
                raise ApplicationError("server-side folders are for staff only", code="forbidden", status=403)
            sources += from_folder(v["folder"], roots=settings.INGEST_ROOTS)
        if not sources:
            raise ApplicationError("send files, a zip, or (staff) a folder", code="no_files")
        with bulk_job(request, len(sources)) as made:
            job = job_services.job_create(owner=request.user, sources=sources, name=v["name"], priority=v["priority"],
                                          deadline=v["deadline"], callbacks=v["callbacks"],
                                          key_prefix=key_prefix_of(request))
            made(job.id)
        return Response({"id": str(job.id), "total": job.total, "url": f"/api/jobs/{job.id}/",
                         "renamed": _renamed(sources), **_callbacks_shown(v["callbacks"])},
                        status=status.HTTP_202_ACCEPTED)

    @staticmethod
    def _remote(user, v: dict, manifest, key_prefix: str) -> Response:
        """A job read by the fetch worker: from an uploaded manifest, a bucket manifest or a prefix."""

        common = {"owner": user, "name": v["name"], "priority": v["priority"], "deadline": v["deadline"],
                  "callbacks": v["callbacks"], "key_prefix": key_prefix}
        if v.get("prefix"):
            exts = [e.strip() for e in (v.get("extensions") or "").split(",") if e.strip()]
            job = reading.job_create_from_prefix(uri=v["prefix"], extensions=exts, **common)
        else:
            job = reading.job_create_from_manifest(upload=manifest, key=v.get("manifest_key"), bucket=v.get("bucket"),
                                                   **common)
        return Response({"id": str(job.id), "total": job.total, "url": f"/api/jobs/{job.id}/", "renamed": [],
                         "reading": True, **_callbacks_shown(v["callbacks"])}, status=status.HTTP_202_ACCEPTED)

    @extend_schema(operation_id="jobs_list", responses={200: JobSerializer(many=True), **errors(404)},
                   description="The caller's jobs (staff: all), newest first, a page at a time.")
    def get(self, request):
        page = self.paginate_queryset(jobs_visible_to(request.user))
        return self.get_paginated_response(JobSerializer(page, many=True).data)


class JobDetailView(APIView):
    """``GET /api/jobs/{id}/``: status, counts, throughput, ETA, failures, stage timings."""

    required_scope = "jobs:read"

    @extend_schema(operation_id="jobs_retrieve", responses={200: JobProgressSerializer, **errors(404)})
    def get(self, request, job_id):
        job = get_object_or_404(jobs_visible_to(request.user), id=job_id)
        return Response({**JobSerializer(job).data, **job_services.job_progress(job),
                         "webhooks": WebhookSerializer(job.webhooks.all(), many=True).data})


class JobActionView(APIView):
    """``POST /api/jobs/{id}/{pause|resume|cancel}/``."""

    required_scope = "jobs:write"

    targets = {"pause": "paused", "resume": "queued", "cancel": "cancelled"}

    @extend_schema(operation_id="jobs_transition", request=None, responses={200: JobSerializer, **errors(404, 409)},
                   parameters=[OpenApiParameter("action", str, OpenApiParameter.PATH, enum=sorted(targets))])
    def post(self, request, job_id, action):
        job = get_object_or_404(jobs_visible_to(request.user), id=job_id)
        if action not in self.targets:
            raise ApplicationError(f"unknown action {action!r}", code="not_found", status=404)
        job = job_services.job_transition(job=job, to=self.targets[action])
        return Response(JobSerializer(job).data)
