from django.urls import path

from embeddings.api import embeddings
from embeddings.api import model_migrations as migrations
from embeddings.api import webhooks
from embeddings.api import exports
from embeddings.api import duplicates
from embeddings.api import images
from embeddings.api import jobs
from embeddings.api import keys
from embeddings.api import search
from embeddings.api import stats
from embeddings.api import tokens
from embeddings.api import usage

urlpatterns = [
    path("auth/token/", tokens.TokenView.as_view(), name="api-token"),
    path("keys/", keys.KeyListView.as_view(), name="keys"),
    path("keys/<int:key_id>/", keys.KeyDetailView.as_view(), name="key-detail"),
    path("images/", images.ImageUploadView.as_view(), name="images"),
    path("images/<uuid:image_id>/", images.ImageDetailView.as_view(), name="image-detail"),
    path("jobs/", jobs.JobListView.as_view(), name="jobs"),
    path("jobs/<uuid:job_id>/", jobs.JobDetailView.as_view(), name="job-detail"),
    path("jobs/<uuid:job_id>/<str:action>/", jobs.JobActionView.as_view(), name="job-action"),
    path("search/", search.SearchView.as_view(), name="search"),
    path("duplicates/", duplicates.DuplicateListView.as_view(), name="duplicates"),
    path("duplicates/scan/", duplicates.DuplicateScanView.as_view(), name="duplicates-scan"),
    path("duplicates/<uuid:group_id>/", duplicates.DuplicateDetailView.as_view(), name="duplicate-detail"),
    path("duplicates/<uuid:group_id>/keep/", duplicates.DuplicateKeepView.as_view(), name="duplicate-keep"),
    path("duplicates/<uuid:group_id>/not-duplicates/", duplicates.DuplicateDismissView.as_view(),
         name="duplicate-dismiss"),
    path("embeddings/", embeddings.EmbeddingsView.as_view(), name="embeddings"),
    path("stats/", stats.StatsView.as_view(), name="stats"),
    path("usage/", usage.UsageView.as_view(), name="usage"),
    path("exports/vectors.<str:fmt>", exports.VectorExportView.as_view(), name="vector-export"),
    path("migrations/", migrations.MigrationListView.as_view(), name="migrations"),
    path("migrations/<int:space_id>/", migrations.MigrationDetailView.as_view(), name="migration-detail"),
    path("migrations/<int:space_id>/<str:action>/", migrations.MigrationActionView.as_view(), name="migration-action"),
    path("webhooks/", webhooks.WebhookListView.as_view(), name="webhooks"),
    path("webhooks/<uuid:webhook_id>/", webhooks.WebhookDetailView.as_view(), name="webhook-detail"),
    path("webhooks/<uuid:webhook_id>/rotate/", webhooks.WebhookRotateView.as_view(), name="webhook-rotate"),
    path("webhooks/<uuid:webhook_id>/deliveries/", webhooks.DeliveryListView.as_view(), name="webhook-deliveries"),
    path("webhooks/<uuid:webhook_id>/deliveries/<int:delivery_id>/redeliver/",
         webhooks.DeliveryRedeliverView.as_view(), name="webhook-redeliver"),
]
