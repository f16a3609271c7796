"""WSGI entry point (``gunicorn project.wsgi`` or ``manage.py runserver``, through
``WSGI_APPLICATION``).

Django builds ``request`` before any middleware runs, and building it parses the ``Content-Type``
header: an RFC 2231 parameter in a charset Python does not know
(``multipart/form-data; boundary=b; charset*=x-no-such-charset''%41``) raises there, and the server
answers its own plain-text 500 on every URL. :class:`Request` survives such a header: it keeps the
bare media type (in ``content_type`` and ``META["CONTENT_TYPE"]``, which DRF and middleware parse
again), no parameters, and the reason in ``content_type_error``; reading the body as a form
(``request.POST`` / ``request.FILES``) is then a 400 (``BadRequest``), and the API answers
400 ``malformed_request`` in its error shape (``embeddings.api.parsers.content_type_error``).
URLs that never read the body (``/healthz``) answer as usual.

Django's test client builds a plain ``WSGIRequest`` in its own handler, so it cannot send such a
header; tests call :data:`application` itself (tests/embeddings/api/test_parsers.py) or gunicorn
(tests/e2e/test_hostile_requests.py).
"""
import os

import django
from django.core.exceptions import BadRequest
from django.core.handlers.wsgi import WSGIHandler, WSGIRequest


class Request(WSGIRequest):
    """A ``WSGIRequest`` that can be built from any ``Content-Type`` header, and whose form
    parsing accounts for every multipart part (``embeddings.api.parsers.MultiPartParser``)."""

    #: Why the Content-Type header could not be parsed (None when it could).
    content_type_error: str | None = None

    def _set_content_type_params(self, meta):
        try:
            super()._set_content_type_params(meta)
        except ValueError as e:  # django.utils.http.parse_header_parameters: unknown RFC 2231 charset
            self.content_type_error = str(e)
            self.content_type = meta.get("CONTENT_TYPE", "").split(";", 1)[0].strip().lower()
            self.content_params = {}
            meta["CONTENT_TYPE"] = self.content_type  # what later code parses: one without parameters

    def _load_post_and_files(self):
        if self.content_type_error is not None and self.method == "POST":
            self._mark_post_parse_error()
            raise BadRequest(f"the Content-Type header cannot be parsed: {self.content_type_error}")
        super()._load_post_and_files()

    def parse_file_upload(self, META, post_data):
        from django.utils.datastructures import ImmutableList

        from embeddings.api.parsers import MultiPartParser

        self.upload_handlers = ImmutableList(self.upload_handlers, warning="You cannot alter upload handlers "
                                             "after the upload has been processed.")
        return MultiPartParser(META, post_data, self.upload_handlers, self.encoding).parse()


class Handler(WSGIHandler):
    """Django's WSGI handler building :class:`Request` objects."""

    request_class = Request


os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
django.setup(set_prefix=False)  # what django.core.wsgi.get_wsgi_application does before the handler
application = Handler()
