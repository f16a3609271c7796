"""The Celery application: every setting comes from Django settings under the ``CELERY_`` prefix."""
import os

from celery import Celery
from celery.signals import task_prerun

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

app = Celery("project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@task_prerun.connect
def close_old_db_connections(sender=None, **kwargs) -> None:
    """Before each task, what Django does before each request: close this thread's database
    connections that are unusable or older than ``CONN_MAX_AGE`` (the rest are reused, their health
    checked on first use: ``CELERY_DB_REUSE_MAX`` keeps Celery from closing them all). Not for eager
    tasks, which run inside their caller's transaction (tests)."""
    if getattr(getattr(sender, "request", None), "is_eager", False):
        return
    from django.db import close_old_connections

    close_old_connections()
