"""WSGI entry point (``gunicorn project.wsgi`` or ``manage.py runserver``)."""
import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
application = get_wsgi_application()
