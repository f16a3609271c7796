from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from embeddings.api.embeddings import OpenAIEmbeddingsView
from embeddings.api.views import healthz
from embeddings.metrics import metrics_view
from embeddings.site.thumbnails import ThumbnailView

urlpatterns = [
    path("healthz", healthz),
    # browsers ask for /favicon.ico on pages that name none (the admin, the API docs)
    path("favicon.ico", RedirectView.as_view(url=static("site/favicon.svg"), permanent=True)),
    path("metrics", metrics_view),
    path("admin/", admin.site.urls),
    path("api/images/<uuid:image_id>/thumbnail/", ThumbnailView.as_view(), name="image-thumbnail"),
    path("api/", include("embeddings.api.urls")),
    # OpenAI's embeddings endpoint, where its clients look for it (base_url=<service>/v1)
    path("v1/embeddings", OpenAIEmbeddingsView.as_view(), name="openai-embeddings"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    path("", include("embeddings.site.urls")),  # the pages for people (embeddings/site)
]

# JSON errors in the API's one shape for /api/ paths (embeddings.api.errors), Django's pages elsewhere
handler404 = "embeddings.api.errors.handler404"
handler500 = "embeddings.api.errors.handler500"
