"""The Django app: models, admin, REST API, services and the Celery tasks that adapt them."""
