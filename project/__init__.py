"""Django project: settings, the Celery app, URLs."""
from project.celery import app as celery_app

__all__ = ("celery_app",)
