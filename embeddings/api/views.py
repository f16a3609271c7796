"""REST endpoints. Each view validates, calls one service, and serialises."""
from __future__ import annotations

from collections.abc import Mapping

from django.conf import settings
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    PolymorphicProxySerializer,
    extend_schema,
)
from rest_framework import status
from rest_framework.authtoken.serializers import AuthTokenSerializer
from rest_framework.authtoken.views import ObtainAuthToken
from rest_framework.generics import GenericAPIView
from rest_framework.parsers import FormParser
from rest_framework.response import Response
from rest_framework.views import APIView

from embeddings.api.catalogue_fields import search_filter, with_identities
from embeddings.api.errors import as_application_error
from embeddings.api.pagination import NewestFirst
from embeddings.api.parsers import DrfMultiPartParser as MultiPartParser
from embeddings.api.parsers import JSONParser
from embeddings.api.parsers import LISTED_PARTS, content_type_error, listed
from embeddings.api.schema import ERROR_STATUS, RETRY_AFTER, errors
from embeddings.api.serializers import (
    ErrorSerializer,
    ImagePatchSerializer,
    ImageSerializer,
    ImageUploadSerializer,
    JobCreatedSerializer,
    JobCreateSerializer,
    JobProgressSerializer,
    JobSerializer,
    JobSubmitSerializer,
    SearchFormSerializer,
    SearchQuerySerializer,
    SearchResponseSerializer,
    SearchSerializer,
    StatsSerializer,
    UploadQuerySerializer,
    UploadResponseSerializer,
    VECTOR_PARAMETERS,
    VectorQuerySerializer,
    VectorView,
)
from embeddings.selectors import images_visible_to, jobs_visible_to
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.interactive import examples as example_services
from embeddings.services.interactive import search as search_services
from embeddings.services.webhooks import endpoints as webhook_services
from embeddings.api.webhook_fields import WebhookCreatedSerializer, WebhookSerializer
from embeddings.services.interactive import upload as request_services
from embeddings.errors import ApplicationError
from embeddings.services.catalogue.images import image_delete
from embeddings.services.catalogue.sources import from_folder, from_uploads, from_zip


def _parsed(request):
    """``(data, files)`` of the request; Django's upload limits become a 4xx naming the limit, an
    unparseable Content-Type a 400 ``malformed_request`` (also when the body is empty)."""
    error = content_type_error(request)
    if error is not None:
        raise error
    length = int(request.META.get("CONTENT_LENGTH") or 0)
    if length > settings.UPLOAD_MAX_REQUEST_BYTES:
        raise ApplicationError(
            f"the request is {length} bytes; UPLOAD_MAX_REQUEST_BYTES is {settings.UPLOAD_MAX_REQUEST_BYTES}",
            code="request_too_large", status=413,
            extra={"limit": "UPLOAD_MAX_REQUEST_BYTES", "value": settings.UPLOAD_MAX_REQUEST_BYTES},
        )
    try:
        return request.data, request.FILES
    except Exception as e:
        err = as_application_error(e) or as_application_error(getattr(e, "__cause__", None) or e)
        if err is not None:
            raise err from e
        raise


def _files(files, *names: str) -> list:
    """The uploaded files of fields ``names``, in the order their parts came in the body."""
    out = []
    for name in names:
        out.extend(files.getlist(name))
    return sorted(out, key=lambda f: getattr(f, "part", 0))


def _check_parts(data, files, *, file_fields: tuple[str, ...]) -> None:
    """Every part sent must be read: a file in a field this endpoint does not read, or a text value
    (a part without ``filename``) in one of its file fields, would otherwise vanish unanswered.

    Raises:
        ApplicationError: ``unexpected_parts`` (400), ``extra.parts`` listing the first such parts
            (``parsers.LISTED_PARTS``), ``extra.refused_count`` counting them all.
    """
    stray = [{"part": getattr(f, "part", None), "field": field, "filename": f.name,
              "reason": f"a file in a field this endpoint does not read ({', '.join(file_fields)})"}
             for field, fs in files.lists() if field not in file_fields for f in fs]
    if hasattr(data, "getlist"):
        stray += [{"part": None, "field": field, "filename": None,
                   "reason": "a text value (no filename in its Content-Disposition) in a file field"}
                  for field in file_fields for v in data.getlist(field) if isinstance(v, str)]
    if stray:
        raise ApplicationError(f"{len(stray)} part(s) of the request cannot be used: "
                               + listed(stray, len(stray), lambda p: f"field {p['field']!r}: {p['reason']}"),
                               code="unexpected_parts",
                               extra={"parts": stray[:LISTED_PARTS], "refused_count": len(stray)})


def _callbacks_shown(callbacks: list) -> dict:
    """A new job's own webhook endpoints with their secrets (shown this once), when it has some."""
    return {"webhooks": WebhookCreatedSerializer(callbacks, many=True).data} if callbacks else {}


def _vector_view(request, images) -> VectorView | None:
    """``include=vector`` of an image request (query parameters): the vectors of ``images`` in the
    active space, one store call for all of them; None when not asked for.

    Raises:
        ApplicationError: ``invalid`` (400: an unknown include or vector_format); the store is
            unavailable (503).
    """
    from embeddings import spaces
    from embeddings.services.vectors import image_vectors

    q = VectorQuerySerializer(data=request.query_params)
    q.is_valid(raise_exception=True)
    if "vector" not in q.validated_data.get("include", set()):
        return None
    model_id = spaces.active().model_id
    return VectorView(model_id=model_id, vector_format=q.validated_data["vector_format"],
                      vectors=image_vectors(images, model_id=model_id))


#: A single refused file answers the upload's own shape with its reason's status; a request refused
#: as a whole answers the error shape (README "API").
UPLOAD_REFUSAL = PolymorphicProxySerializer(
    component_name="UploadRefusal", serializers=[UploadResponseSerializer, ErrorSerializer],
    resource_type_field_name=None)


def _upload_refusal(status_code: int) -> OpenApiResponse:
    return OpenApiResponse(UPLOAD_REFUSAL, description=f"the only file refused ({status_code} by its reason, in "
                                                       f"the upload's shape), or: {ERROR_STATUS[status_code]}")


class TokenView(ObtainAuthToken):
    """``POST /api/auth/token/``: a user's token for a username and password (no authentication)."""

    parser_classes = (FormParser, MultiPartParser, JSONParser)  # ours: DRF's view names DRF's own

    @extend_schema(operation_id="auth_token", auth=[], request=AuthTokenSerializer,
                   responses={200: AuthTokenSerializer, **errors(400)})
    def post(self, request, *args, **kwargs):
        return super().post(request, *args, **kwargs)


def _renamed(sources) -> list[dict]:
    """``[{"name", "raw_name"}]`` of the sources whose display name is not the name sent."""
    return [{"name": s.name, "raw_name": s.raw_name} for s in sources if s.raw_name is not None]


class ImageUploadView(GenericAPIView):
    """``POST /api/images/``: 1..N images on the interactive lane; ``GET``: the caller's images."""

    parser_classes = (MultiPartParser, FormParser)
    pagination_class = NewestFirst
    serializer_class = ImageSerializer

    @extend_schema(
        operation_id="images_upload", request={"multipart/form-data": ImageUploadSerializer},
        parameters=[RETRY_AFTER],
        description="Embed 1..INTERACTIVE_MAX_FILES images and answer each one's neighbours within the deadline. "
                    "When the only file is refused the status follows its reason (400/413/415/422) in the same shape; "
                    "a request refused as a whole answers the error shape.",
        responses={200: UploadResponseSerializer,
                   202: OpenApiResponse(UploadResponseSerializer,
                                        description="the deadline passed: the work continues, poll each image's url"),
                   400: _upload_refusal(400), 413: _upload_refusal(413), 415: _upload_refusal(415),
                   422: _upload_refusal(422), **errors(429, 503)})
    def post(self, request):
        data, files = _parsed(request)
        _check_parts(data, files, file_fields=("files", "file", "image"))
        uploads = _files(files, "files", "file", "image")
        if not uploads:
            raise ApplicationError("send one or more image files in the 'files' field", code="no_files")
        if len(uploads) > settings.INTERACTIVE_MAX_FILES:
            raise ApplicationError(
                f"{len(uploads)} files; an interactive request takes at most INTERACTIVE_MAX_FILES "
                f"({settings.INTERACTIVE_MAX_FILES}); use POST /api/jobs/ for more",
                code="too_many_files",
                extra={"limit": "INTERACTIVE_MAX_FILES", "value": settings.INTERACTIVE_MAX_FILES, "files": len(uploads)},
            )
        q = UploadQuerySerializer(data=data)
        q.is_valid(raise_exception=True)
        deadline_s = request_services.deadline_for(q.validated_data.get("deadline"))
        sources = with_identities(data, from_uploads(uploads))
        outcome = request_services.images_upload(
            owner=request.user, sources=sources, deadline_s=deadline_s, k=q.validated_data["k"]
        )
        # images_upload answers one entry per source, in order: a replaced name is shown as sent
        images = [im if src.raw_name is None else {**im, "raw_name": src.raw_name}
                  for im, src in zip(outcome.images, sources)]
        return Response({"images": images, "deadline_s": deadline_s}, status=outcome.status)

    @extend_schema(operation_id="images_list", responses={200: ImageSerializer(many=True), **errors(400, 404, 503)},
                   parameters=[OpenApiParameter("external_id", str, OpenApiParameter.QUERY,
                                                description="only the image with this id of yours"),
                               *VECTOR_PARAMETERS, RETRY_AFTER],
                   description="The caller's images (staff: all), newest first, a page at a time; with "
                               "include=vector each with its stored vector (one store read per page).")
    def get(self, request):
        images = images_visible_to(request.user).select_related("duplicate_of")
        if "external_id" in request.query_params:
            wanted = request.query_params["external_id"]
            # no image holds "" (no id) or an id with NUL (PostgreSQL cannot even compare one)
            images = images.filter(external_id=wanted) if wanted and "\x00" not in wanted else images.none()
        page = self.paginate_queryset(images)
        vectors = _vector_view(request, page)
        return self.get_paginated_response(ImageSerializer(page, many=True, context={"vectors": vectors}).data)


class ImageDetailView(APIView):
    """``GET`` / ``PATCH`` / ``DELETE /api/images/{id}/`` (delete removes the vector too)."""

    parser_classes = (JSONParser,)

    @extend_schema(operation_id="images_partial_update", request=ImagePatchSerializer,
                   responses={200: ImageSerializer, **errors(400, 404, 409, 415, 503)}, parameters=[RETRY_AFTER],
                   description="Change your external_id and/or metadata (replaced whole) without re-embedding; the "
                               "vector's payload follows before the answer, so the next search filters by it.")
    def patch(self, request, image_id):
        from embeddings.services.catalogue.identity import image_update

        im = get_object_or_404(images_visible_to(request.user), id=image_id)
        s = ImagePatchSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        unknown = sorted(set(request.data) - set(s.fields)) if isinstance(request.data, dict) else []
        if unknown:
            raise ApplicationError(f"fields that cannot be changed: {', '.join(unknown)}", code="invalid",
                                   extra={"fields": unknown})
        im = image_update(image=im, fields={k: request.data[k] for k in s.validated_data})
        return Response(ImageSerializer(im).data)

    @extend_schema(operation_id="images_retrieve", responses={200: ImageSerializer, **errors(400, 404, 503)},
                   parameters=[*VECTOR_PARAMETERS, RETRY_AFTER])
    def get(self, request, image_id):
        im = get_object_or_404(images_visible_to(request.user), id=image_id)
        return Response(ImageSerializer(im, context={"vectors": _vector_view(request, [im])}).data)

    @extend_schema(operation_id="images_destroy", responses={204: None, **errors(404, 503)}, parameters=[RETRY_AFTER])
    def delete(self, request, image_id):
        im = get_object_or_404(images_visible_to(request.user), id=image_id)
        image_delete(image=im)
        return Response(status=status.HTTP_204_NO_CONTENT)


class JobListView(GenericAPIView):
    """``POST /api/jobs/``: a bulk job from files, a zip, or (staff) a server folder; ``GET``: jobs."""

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
        data, files = _parsed(request)
        _check_parts(data, files, file_fields=("files", "file", "zip", "manifest"))
        s = JobCreateSerializer(data=data)
        s.is_valid(raise_exception=True)
        v = s.validated_data
        # webhooks (issue 42): the job's callback URLs are checked before any job exists
        v["callbacks"] = webhook_services.job_callbacks_prepare(owner=request.user, urls=v.get("callback_url") or [],
                                                                events=v.get("callback_events"))
        manifests = _files(files, "manifest")
        remote = len(manifests) + bool(v.get("manifest_key")) + bool(v.get("prefix"))
        if remote:
            if remote > 1 or _files(files, "files", "file", "zip") or v.get("folder"):
                raise ApplicationError("a job reads one source: files and zips, a folder, a manifest, a manifest_key "
                                       "or a prefix", code="mixed_sources")
            return self._remote(request.user, v, manifests[0] if manifests else None)
        sources = with_identities(data, from_uploads(_files(files, "files", "file")))
        for archive in _files(files, "zip"):
            sources += from_zip(archive, max_entries=settings.ZIP_MAX_ENTRIES,
                                max_uncompressed=settings.ZIP_MAX_UNCOMPRESSED_BYTES,
                                max_ratio=settings.ZIP_MAX_RATIO, max_entry_bytes=settings.PIPELINE.max_image_bytes)
        if v.get("folder"):
            if not request.user.is_staff:
                raise ApplicationError("server-side folders are for staff only", code="forbidden", status=403)
            sources += from_folder(v["folder"], roots=settings.INGEST_ROOTS)
        if not sources:
            raise ApplicationError("send files, a zip, or (staff) a folder", code="no_files")
        job = job_services.job_create(owner=request.user, sources=sources, name=v["name"], priority=v["priority"],
                                      deadline=v["deadline"], callbacks=v["callbacks"])
        return Response({"id": str(job.id), "total": job.total, "url": f"/api/jobs/{job.id}/",
                         "renamed": _renamed(sources), **_callbacks_shown(v["callbacks"])},
                        status=status.HTTP_202_ACCEPTED)

    @staticmethod
    def _remote(user, v: dict, manifest) -> Response:
        """A job read by the fetch worker: from an uploaded manifest, a bucket manifest or a prefix."""
        from embeddings.services.catalogue import reading

        common = {"owner": user, "name": v["name"], "priority": v["priority"], "deadline": v["deadline"],
                  "callbacks": v["callbacks"]}
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

    @extend_schema(operation_id="jobs_retrieve", responses={200: JobProgressSerializer, **errors(404)})
    def get(self, request, job_id):
        job = get_object_or_404(jobs_visible_to(request.user), id=job_id)
        return Response({**JobSerializer(job).data, **job_services.job_progress(job),
                         "webhooks": WebhookSerializer(job.webhooks.all(), many=True).data})


class JobActionView(APIView):
    """``POST /api/jobs/{id}/{pause|resume|cancel}/``."""

    targets = {"pause": "paused", "resume": "queued", "cancel": "cancelled"}

    @extend_schema(operation_id="jobs_transition", request=None, responses={200: JobSerializer, **errors(404, 409)},
                   parameters=[OpenApiParameter("action", str, OpenApiParameter.PATH, enum=sorted(targets))])
    def post(self, request, job_id, action):
        job = get_object_or_404(jobs_visible_to(request.user), id=job_id)
        if action not in self.targets:
            raise ApplicationError(f"unknown action {action!r}", code="not_found", status=404)
        job = job_services.job_transition(job=job, to=self.targets[action])
        return Response(JobSerializer(job).data)


#: The file parts a search reads: the query image, or uploaded examples.
SEARCH_FILES = ("image", "positive_image", "negative_image")


def _examples(value, side: str) -> list[dict]:
    """A search's ``positive`` / ``negative`` list (JSON, or its JSON text in a form, parsed by the
    serializer) → ``[{"image_id": str} | {"text": str}]``.

    Raises:
        ApplicationError: ``too_many_examples`` (400: more than ``MAX_EXAMPLES``, before any item
            is read), ``invalid_example`` (400, ``extra.example``: ``"positive[3]"``): not a list,
            or an item that is not an object with exactly one of ``image_id`` (a UUID) or ``text``
            (not blank, at most 2,000 characters, no NUL).
    """
    import uuid as _uuid

    if value is None:
        return []
    if not isinstance(value, list):
        raise ApplicationError(f"{side} must be a list of examples", code="invalid_example", extra={"example": side})
    if len(value) > example_services.MAX_EXAMPLES:
        raise ApplicationError(f"{len(value)} {side} examples; at most MAX_EXAMPLES = {example_services.MAX_EXAMPLES}",
                               code="too_many_examples", extra={"limit": "MAX_EXAMPLES",
                                                                "value": example_services.MAX_EXAMPLES})
    out = []
    for i, item in enumerate(value):
        where = f"{side}[{i}]"
        if not isinstance(item, dict) or len(item) != 1 or not ({"image_id", "text"} & set(item)):
            raise ApplicationError(f"{where}: an object with exactly one of image_id or text", code="invalid_example",
                                   extra={"example": where})
        if "image_id" in item:
            try:
                out.append({"image_id": str(_uuid.UUID(str(item["image_id"])))})
            except (ValueError, TypeError, AttributeError):
                raise ApplicationError(f"{where}: image_id is not a UUID", code="invalid_example",
                                       extra={"example": where}) from None
            continue
        text = item["text"]
        if not isinstance(text, str) or not text.strip() or "\x00" in text or len(text) > 2000:
            raise ApplicationError(f"{where}: text must be a non-blank string of at most 2000 characters, no NUL",
                                   code="invalid_example", extra={"example": where})
        out.append({"text": text})
    return out


class SearchView(APIView):
    """``POST /api/search/``: by text, by an uploaded image, by a stored image's id, or by positive
    and negative examples of those kinds."""

    parser_classes = (MultiPartParser, FormParser, JSONParser)

    @extend_schema(
        operation_id="search",
        request={"application/json": SearchQuerySerializer, "multipart/form-data": SearchFormSerializer},
        parameters=[RETRY_AFTER],
        description="Top-k of the caller's images (staff: all) by exactly one of a text, an uploaded image "
                    "(multipart) or a stored image's id; or by `positive` (and `negative`) examples, each a stored "
                    "image's id, a text or (multipart) an uploaded image, scored by `strategy`. Any search may ask "
                    "for diverse results (`diversity`, `candidates`). docs/search.md.",
        responses={200: SearchResponseSerializer, **errors(400, 404, 409, 413, 415, 422, 429, 503, 504)})
    def post(self, request):
        data, files = _parsed(request)
        _check_parts({}, files, file_fields=SEARCH_FILES)
        # multipart is the image's form (the schema's SearchForm): a text or an id alone goes as JSON
        multipart = request.content_type.startswith("multipart/")
        # a JSON body that is not an object (null, a number, a list) is the serializer's 400 below
        by_examples = (isinstance(data, Mapping) and any(f in data for f in ("positive", "negative"))) or any(
            f in files for f in ("positive_image", "negative_image"))
        if multipart and "image" not in files and not by_examples:
            raise ApplicationError("a multipart search carries the image file part 'image' (or examples); search by "
                                   "text or image_id with a JSON body", code="invalid_query", status=400,
                                   extra={"fields": ["image"]})
        s = SearchSerializer(data=data)
        s.is_valid(raise_exception=True)
        v = s.validated_data
        single = [f for f in ("text", "image_id") if v.get(f) is not None] + (["image"] if "image" in files else [])
        if by_examples and single:
            raise ApplicationError("give either text, image or image_id, or positive/negative examples, not both",
                                   code="invalid_query", extra={"fields": single + ["positive"]})
        if not by_examples and v.get("strategy") is not None:
            raise ApplicationError("strategy applies to a search by positive/negative examples",
                                   code="invalid_query", extra={"fields": ["strategy"]})
        if by_examples:
            positive = _examples(v.get("positive"), "positive")
            negative = _examples(v.get("negative"), "negative")
            uploads = {side: _files(files, f"{side}_image") for side in ("positive", "negative")}
            total = len(positive) + len(negative) + sum(len(u) for u in uploads.values())
            if total > example_services.MAX_EXAMPLES:
                raise ApplicationError(f"{total} examples; at most MAX_EXAMPLES = {example_services.MAX_EXAMPLES}",
                                       code="too_many_examples", extra={"limit": "MAX_EXAMPLES",
                                                                        "value": example_services.MAX_EXAMPLES})
        where = search_filter(data.get("filter") if hasattr(data, "get") else None)  # refused before any bytes are kept
        from embeddings.services.lifecycle import cutoff
        from embeddings import spaces

        space = spaces.active()  # the space this search reads (cached: the one search() uses)
        with_vectors = "vector" in v.get("include", set())
        scope = dict(user=request.user, k=v["k"], job_id=str(v["job_id"]) if v.get("job_id") else None, where=where,
                     with_vectors=with_vectors, diversity=v["diversity"], candidates=v.get("candidates"))
        if by_examples:
            for side, found in uploads.items():
                (positive if side == "positive" else negative).extend({"image": src} for src in from_uploads(found))
            from workers.vector_store import DEFAULT_STRATEGY

            strategy = v.get("strategy") or DEFAULT_STRATEGY
            results = example_services.search_examples(positive=positive, negative=negative, strategy=strategy,
                                                       **scope)
        else:
            image = from_uploads([v["image"]])[0] if v.get("image") else None
            results = search_services.search(
                text=v.get("text"), image=image, image_id=str(v["image_id"]) if v.get("image_id") else None, **scope)
        if with_vectors and v["vector_format"] == "float":  # the store answers base64
            from embeddings.messages import decode_vector

            results = [{**r, "vector": decode_vector(r["vector"]).tolist()} if "vector" in r else r for r in results]
        if by_examples:  # scores of a strategy are not cosines: only a requested min_score cuts
            kept = results if not v.get("min_score") else [r for r in results if r["score"] >= v["min_score"]]
            answer = {"results": kept, "model_id": space.model_id, "min_score": v.get("min_score") or None,
                      "min_score_source": cutoff.REQUEST, "strategy": strategy}
        else:
            answer = cutoff.apply_min_score(results, space=space, kind=cutoff.TEXT if v.get("text") is not None
                                            else cutoff.IMAGE, requested=v.get("min_score"))
        return Response({**answer, "k": v["k"]})


class StatsView(APIView):
    """``GET /api/stats/`` (staff): images per status in the database, points in the collection, and
    stage timings per lane."""

    @extend_schema(operation_id="stats", responses={200: StatsSerializer, **errors(403, 503)},
                   parameters=[RETRY_AFTER], description="**Staff only** (403 `forbidden` for other users).",
                   extensions={"x-staff-only": True})
    def get(self, request):
        from django.db.models import Count

        from embeddings.models import Image
        from embeddings import sink

        if not request.user.is_staff:
            raise ApplicationError("staff only", code="forbidden", status=403)
        from embeddings.models import EmbeddingSpace
        from embeddings import spaces

        users = Image.objects.filter(source__isnull=True)  # the users' rows, not migration copies (issue 13)
        counts = {r["status"]: r["n"] for r in users.values("status").annotate(n=Count("id"))}
        distinct = users.filter(status="embedded").values("sha256").distinct().count()
        active = spaces.active()
        store = sink.store_call("collection_stats", active.model_id)
        embedded = dict(Image.objects.filter(status="embedded").values("model_id").annotate(n=Count("id"))
                        .values_list("model_id", "n"))
        per_space = [{"model_id": sp.model_id, "state": sp.state, "collection": sp.collection,
                      "embedded_rows": embedded.get(sp.model_id, 0)} for sp in EmbeddingSpace.objects.all()]
        from embeddings.metrics import lane_summaries

        return Response({"images": counts, "distinct_embedded": distinct, **store, "model_id": active.model_id,
                         "spaces": per_space,
                         "lanes": lane_summaries()})  # stage min/avg/max/p95 over each lane's last batches


def healthz(request):
    """Liveness of the web process (no authentication, no dependencies)."""
    from django.http import JsonResponse

    return JsonResponse({"ok": True})
