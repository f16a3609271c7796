"""URLs of the site (mounted at ``/`` by ``project.urls``)."""
from django.contrib.auth import views as auth_views
from django.urls import path

from embeddings.site import duplicates, keys, usage, views

urlpatterns = [
    path("", views.home, name="site-home"),
    path("login/", auth_views.LoginView.as_view(template_name="site/login.html", redirect_authenticated_user=True),
         name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("search/", views.search, name="site-search"),
    path("upload/", views.upload, name="site-upload"),
    path("jobs/", views.job_list, name="site-jobs"),
    path("jobs/<uuid:job_id>/", views.job_detail, name="site-job"),
    path("images/<uuid:image_id>/", views.image_detail, name="site-image"),
    path("images/<uuid:image_id>/delete/", views.image_remove, name="site-image-delete"),
    path("keys/", keys.keys, name="site-keys"),
    path("keys/<int:key_id>/revoke/", keys.key_revoke, name="site-key-revoke"),
    path("duplicates/", duplicates.duplicates, name="site-duplicates"),
    path("duplicates/scan/", duplicates.duplicates_scan, name="site-duplicates-scan"),
    path("duplicates/<uuid:group_id>/keep/", duplicates.duplicates_keep, name="site-duplicates-keep"),
    path("duplicates/<uuid:group_id>/not-duplicates/", duplicates.duplicates_dismiss, name="site-duplicates-dismiss"),
    path("usage/", usage.usage, name="site-usage"),
]
