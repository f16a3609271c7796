"""Tests of the REST API (``embeddings/api/``), one module per API module: each resource's views
and serializers through the Django test client or the WSGI callable, end to end in one process
(eager Celery, the embedded store, the random-weights model; fixtures in tests/embeddings/conftest.py).
"""
