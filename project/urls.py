from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from embeddings.api.views import healthz
from embeddings.metrics import metrics_view

urlpatterns = [
    path("healthz", healthz),
    path("metrics", metrics_view),
    path("admin/", admin.site.urls),
    path("api/", include("embeddings.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
]

# JSON errors in the API's one shape for /api/ paths (embeddings.api.errors), Django's pages elsewhere
handler404 = "embeddings.api.errors.handler404"
handler500 = "embeddings.api.errors.handler500"
