from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

from embeddings.admin import view_on_site as admin_view_on_site
from embeddings.api import batches as openai_batches
from embeddings.api.embeddings import OpenAIEmbeddingsView
from embeddings.api.health import healthz, readyz
from embeddings.api.schema import DocsView, SchemaView
from embeddings.metrics import metrics_view
from embeddings.site.thumbnails import ThumbnailView

urlpatterns = [
    path("healthz", healthz),
    path("readyz", readyz),
    # browsers ask for /favicon.ico on pages that name none (the admin, the API docs)
    path("favicon.ico", RedirectView.as_view(url=static("site/favicon.svg"), permanent=True)),
    path("metrics", metrics_view),
    # Django's "view on site" redirect, a 404 for an id its model's key cannot hold (embeddings.admin)
    path("admin/r/<path:content_type_id>/<path:object_id>/", admin.site.admin_view(admin_view_on_site)),
    path("admin/", admin.site.urls),
    path("api/images/<uuid:image_id>/thumbnail/", ThumbnailView.as_view(), name="image-thumbnail"),
    path("api/", include("embeddings.api.urls")),
    # OpenAI's embeddings endpoint, where its clients look for it (base_url=<service>/v1)
    path("v1/embeddings", OpenAIEmbeddingsView.as_view(), name="openai-embeddings"),
    # OpenAI's Batch API over the bulk lane (docs/batch-api.md)
    path("v1/files", openai_batches.FileListView.as_view(), name="openai-files"),
    path("v1/files/<str:file_id>", openai_batches.FileDetailView.as_view(), name="openai-file"),
    path("v1/files/<str:file_id>/content", openai_batches.FileContentView.as_view(), name="openai-file-content"),
    path("v1/batches", openai_batches.BatchListView.as_view(), name="openai-batches"),
    path("v1/batches/<str:batch_id>", openai_batches.BatchDetailView.as_view(), name="openai-batch"),
    path("v1/batches/<str:batch_id>/cancel", openai_batches.BatchCancelView.as_view(), name="openai-batch-cancel"),
    path("api/schema/", SchemaView.as_view(), name="schema"),  # version/lang/format made harmless
    path("api/docs/", DocsView.as_view(url_name="schema"), name="docs"),  # the page whatever Accept says
    path("", include("embeddings.site.urls")),  # the pages for people (embeddings/site)
]

# Errors outside the views in the shape of their area: the API's under /api/, OpenAI's under /v1/,
# the site's page elsewhere (embeddings/transport.py)
handler400 = "embeddings.transport.handler400"
handler403 = "embeddings.transport.handler403"
handler404 = "embeddings.transport.handler404"
handler500 = "embeddings.transport.handler500"
