"""Multipart parsing in which no part disappears, and a Content-Type header that cannot be parsed
is a 400, not a 500.

Django's ``MultiPartParser`` drops parts without a word: a header line it cannot parse (an RFC 2231
parameter with an unknown charset, ``filename*=x-no-such-charset''a.png``, or bytes that are not
UTF-8) is skipped, and the part with it; a file part whose ``filename`` is empty becomes a text
field; one whose name sanitises to nothing (``holiday.png/``, ``..``, a tab) is skipped. Here every
part between the first boundary and the closing one is accounted for:

- a part with a ``filename`` parameter (even empty, even undecodable) is a file; its display name
  is :func:`~embeddings.services.catalogue.sources.safe_name` of the name sent, or ``upload-N`` (N: the
  part's 1-based position in the body) when nothing usable is left. The uploaded file carries
  ``part`` (N) and ``raw_name`` (the name as sent, decoded leniently);
- a part without a usable ``Content-Disposition`` (missing, or without ``name``) is refused: the
  request fails with :class:`RefusedParts`, which counts every such part and lists the first
  :data:`LISTED_PARTS`;
- every part counts against :func:`max_parts` (Django's limits count fields and files, and a part
  without a name is neither): past it the body is parsed no further (:class:`TooManyParts`);
- a body that cannot be split into parts (no closing boundary, headers longer than 1 KiB, broken
  base64) fails with :class:`~django.http.multipartparser.MultiPartParserError`.

Django's limits (``DATA_UPLOAD_MAX_NUMBER_FILES``, ``DATA_UPLOAD_MAX_NUMBER_FIELDS``,
``DATA_UPLOAD_MAX_MEMORY_SIZE``) and upload handlers work as in Django. The DRF classes at the end
turn these errors into the API's error shape (``malformed_request``, ``malformed_multipart``).
"""
from __future__ import annotations

import base64
import binascii
import codecs
import os
from email.message import Message
from email.utils import collapse_rfc2231_value

from django.conf import settings
from django.core.exceptions import (
    RequestDataTooBig,
    SuspiciousMultipartForm,
    TooManyFieldsSent,
    TooManyFilesSent,
)
from django.core.files.uploadhandler import SkipFile, StopFutureHandlers, StopUpload
from django.http import QueryDict
from django.http.multipartparser import (
    MAX_TOTAL_HEADER_SIZE,
    ChunkIter,
    InterBoundaryIter,
    LazyStream,
    MultiPartParserError,
    exhaust,
)
from django.http.multipartparser import MultiPartParser as DjangoMultiPartParser
from django.utils.datastructures import MultiValueDict
from django.utils.http import parse_header_parameters
from rest_framework import parsers as drf_parsers
from rest_framework.negotiation import DefaultContentNegotiation

from embeddings.api import json_input
from embeddings.errors import ApplicationError
from embeddings.services.catalogue.sources import safe_name

#: Refused parts an answer lists; the others are only counted, so that an answer stays a few KB
#: whatever the body holds (20,000 parts without headers once made a 1.98 MB answer to 260 KB).
LISTED_PARTS = 10


def listed(parts: list[dict], count: int, describe) -> str:
    """``"a; b; c"`` of the first :data:`LISTED_PARTS` of ``parts`` (``describe(part)`` each),
    then ``"; and N more"`` when ``count`` is larger."""
    text = "; ".join(describe(p) for p in parts[:LISTED_PARTS])
    return text + (f"; and {count - LISTED_PARTS} more" if count > LISTED_PARTS else "")


class RefusedParts(MultiPartParserError):
    """Parts of a multipart body that cannot be used: ``count`` of them, the first
    :data:`LISTED_PARTS` in ``parts`` as ``{"part": N (1-based position in the body), "reason": str}``."""

    def __init__(self, parts: list[dict], count: int) -> None:
        self.parts, self.count = parts[:LISTED_PARTS], count
        super().__init__(f"{count} unusable multipart part(s): "
                         + listed(parts, count, lambda p: f"part {p['part']} ({p['reason']})"))


class TooManyParts(RefusedParts):
    """More parts than :func:`max_parts` (``limit``); ``parts`` and ``count``: the refused parts
    among those read before the limit, as :class:`RefusedParts`."""

    def __init__(self, limit: int, parts: list[dict], count: int) -> None:
        super().__init__(parts, count)
        self.limit = limit
        self.args = (f"more than {limit} parts (DATA_UPLOAD_MAX_NUMBER_FIELDS + DATA_UPLOAD_MAX_NUMBER_FILES), "
                     f"parsed no further" + (f"; of the first {limit}, {self.args[0]}" if count else ""),)


class _Refused:
    """Refused parts as a body is read: all counted, the first :data:`LISTED_PARTS` kept."""

    def __init__(self) -> None:
        self.first: list[dict] = []
        self.count = 0

    def add(self, n: int, reason: str) -> None:
        self.count += 1
        if len(self.first) < LISTED_PARTS:
            self.first.append({"part": n, "reason": reason})


def max_parts() -> int | None:
    """Most parts a multipart body may have: ``DATA_UPLOAD_MAX_NUMBER_FIELDS`` +
    ``DATA_UPLOAD_MAX_NUMBER_FILES`` (every usable part is a field or a file, each counted against
    its own limit; a part that is neither would otherwise be read without bound). None when either
    limit is off (None), as Django reads None."""
    fields, files = settings.DATA_UPLOAD_MAX_NUMBER_FIELDS, settings.DATA_UPLOAD_MAX_NUMBER_FILES
    return None if fields is None or files is None else fields + files


def header_params(value: str) -> tuple[str, dict[str, str]]:
    """``"form-data; name=x; filename=y"`` → ``("form-data", {"name": "x", "filename": "y"})``.

    Django's :func:`~django.utils.http.parse_header_parameters` for every header it accepts; where
    it raises (an RFC 2231 value such as ``filename*=x-unknown''a%20b.png`` in a charset Python
    does not know), the value's percent-decoded bytes are read as UTF-8 (undecodable bytes become
    U+FFFD) instead of losing the parameter. Never raises: a header the email parser cannot read
    at all gives ``("", {})``.
    """
    try:
        return parse_header_parameters(value)
    except ValueError:
        pass
    try:
        m = Message()
        m["content-type"] = value
        params = m.get_params() or [("", "")]
    except Exception:  # the stdlib email parser's failure modes are not documented: any is "unreadable"
        return "", {}
    key = params.pop(0)[0].lower()
    out = {}
    for name, v in params:
        if not name:
            continue
        if isinstance(v, tuple):
            charset, lang, text = v
            try:
                codecs.lookup(charset or "us-ascii")
            except LookupError:
                charset = "utf-8"
            v = collapse_rfc2231_value((charset, lang, text), errors="replace")
        out[name.lower()] = v
    return key, out


def _decode_header_line(line: bytes) -> str:
    """Header bytes → text: UTF-8, else ISO-8859-1 (HTTP's historical header charset), so that no
    byte sequence makes a header unreadable."""
    try:
        return line.decode()
    except UnicodeDecodeError:
        return line.decode("latin-1")


def _part_headers(stream: LazyStream, n: int) -> dict[str, tuple[str, dict[str, str]]] | None:
    """Read one part's header block from ``stream`` → ``{lowercase name: (value, params)}``, or None
    when the part has no header block (it ends before the blank line and holds no header line).

    Raises:
        MultiPartParserError: no blank line within ``MAX_TOTAL_HEADER_SIZE`` (1,024) bytes.
    """
    chunk = stream.read(MAX_TOTAL_HEADER_SIZE)
    end = chunk.find(b"\r\n\r\n")
    _, _, lines = chunk.partition(b"\r\n")
    if end < 0 and len(chunk) < MAX_TOTAL_HEADER_SIZE and b":" in lines:
        # The whole part is header lines, no body: RFC 2046's body-part is headers [CRLF *OCTET], and
        # the CRLF before the next delimiter belongs to the delimiter (werkzeug writes an empty file so).
        end = len(chunk)
    if end < 0:
        stream.unget(chunk)
        if len(chunk) >= MAX_TOTAL_HEADER_SIZE:
            raise MultiPartParserError(f"part {n}: headers longer than {MAX_TOTAL_HEADER_SIZE} bytes")
        return None
    stream.unget(chunk[end + 4:])
    headers = {}
    # The first line is what follows the boundary on its line (transport padding): not a header.
    for line in chunk[:end].split(b"\r\n")[1:]:
        name, sep, value = _decode_header_line(line).partition(":")
        if sep:
            headers[name.strip().lower()] = header_params(value.strip())
    return headers


def _parts(stream: LazyStream, boundary: bytes):
    """Yield ``(n, headers or None, body stream)`` for each part of a multipart body (n from 1).

    The preamble and the epilogue (after the closing ``--boundary--``) are ignored as RFC 2046
    says.

    Raises:
        MultiPartParserError: the body ends before the closing boundary (or has none).
    """
    subs = InterBoundaryIter(stream, b"--" + boundary)
    preamble = next(subs, None)
    if preamble is not None:
        exhaust(preamble)
    for n, sub in enumerate(subs, start=1):
        head = sub.read(2)
        if head == b"--":  # the closing delimiter
            exhaust(sub)
            exhaust(stream)
            return
        sub.unget(head)
        yield n, _part_headers(sub, n), sub
        exhaust(sub)
    raise MultiPartParserError("the body ends before the closing boundary")


class MultiPartParser(DjangoMultiPartParser):
    """Django's ``MultiPartParser`` with the accounting described in this module's docstring.

    Returns ``(POST QueryDict, FILES MultiValueDict)`` like Django's.

    Raises:
        MultiPartParserError: a Content-Type or body that cannot be parsed; :class:`RefusedParts`
            when parts without a usable Content-Disposition were sent; :class:`TooManyParts`.
        TooManyFilesSent, TooManyFieldsSent, RequestDataTooBig: Django's limits.

    Whatever it raises, no uploaded file is left open: the files already parsed and the one being
    received (a temporary file on disk for a large part) are closed, which deletes them; and the
    rest of a refused body is read and dropped unparsed (:func:`_drain`).
    """

    def __init__(self, META, input_data, upload_handlers, encoding=None):
        try:
            super().__init__(META, input_data, upload_handlers, encoding)
        except ValueError as e:  # parse_header_parameters on the request's Content-Type
            raise MultiPartParserError(f"Content-Type cannot be parsed: {e}") from e

    def parse(self):
        try:
            return super().parse()  # closes the files in self._files when _parse raises
        except BaseException as e:
            self._close_files()  # and the one a handler was receiving when it raised
            if isinstance(e, Exception):  # not on a worker's timeout abort (SystemExit)
                _drain(self._input_data)
            raise

    def _parse(self):
        if self._content_length == 0:
            return QueryDict(encoding=self._encoding), MultiValueDict()
        for handler in self._upload_handlers:
            result = handler.handle_raw_input(self._input_data, self._meta, self._content_length, self._boundary,
                                              self._encoding)
            if result is not None:
                return result[0], result[1]
        self._post = QueryDict(mutable=True)
        self._files = MultiValueDict()
        self._field_bytes = self._n_fields = self._n_files = 0
        refused, limit = _Refused(), max_parts()
        stream = LazyStream(ChunkIter(self._input_data, self._chunk_size))
        try:
            for n, headers, body in _parts(stream, self._boundary):
                if limit is not None and n > limit:
                    raise TooManyParts(limit, refused.first, refused.count)
                disposition = (headers or {}).get("content-disposition")
                if headers is None:
                    refused.add(n, "no header block")
                elif disposition is None:
                    refused.add(n, "no Content-Disposition header")
                elif "name" not in disposition[1]:
                    refused.add(n, "Content-Disposition without a name")
                elif "filename" in disposition[1]:
                    problem = self._file(n, headers, body)
                    if problem:
                        refused.add(n, problem)
                else:
                    self._field(headers, body)
        except StopUpload as e:  # a handler gave up on the whole request: never a silent partial parse
            self._close_files()
            raise MultiPartParserError(f"an upload handler stopped the upload: {e!r}") from e
        if refused.count:
            raise RefusedParts(refused.first, refused.count)
        any(handler.upload_complete() for handler in self._upload_handlers)
        self._post._mutable = False
        return self._post, self._files

    def _field(self, headers: dict, body: LazyStream) -> None:
        """A text field, with Django's limits on their number and total size."""
        self._n_fields += 1
        limit = settings.DATA_UPLOAD_MAX_NUMBER_FIELDS
        if limit is not None and self._n_fields > limit:
            raise TooManyFieldsSent(
                "The number of GET/POST parameters exceeded settings.DATA_UPLOAD_MAX_NUMBER_FIELDS.")
        name = headers["content-disposition"][1]["name"].strip()
        max_bytes = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        data = body.read(None if max_bytes is None else max(0, max_bytes - self._field_bytes) + 1)
        if _transfer_encoding(headers) == "base64":
            try:
                data = base64.b64decode(data)
            except binascii.Error:
                pass  # Django keeps undecodable base64 fields as sent
        self._field_bytes += len(data) + len(name) + 2  # as Django counts: the urlencoded "&name="
        if max_bytes is not None and self._field_bytes > max_bytes:

            raise RequestDataTooBig("Request body exceeded settings.DATA_UPLOAD_MAX_MEMORY_SIZE.")
        self._post.appendlist(name, data.decode(self._encoding, errors="replace"))

    def _file(self, n: int, headers: dict, body: LazyStream) -> str | None:
        """Feed one file part to the upload handlers; returns a reason when no handler kept it."""
        self._n_files += 1
        limit = settings.DATA_UPLOAD_MAX_NUMBER_FILES
        if limit is not None and self._n_files > limit:
            raise TooManyFilesSent("The number of files exceeded settings.DATA_UPLOAD_MAX_NUMBER_FILES.")
        params = headers["content-disposition"][1]
        field = params["name"].strip()
        raw_name = params["filename"]
        file_name = safe_name(raw_name, fallback=f"upload-{n}")
        stem, ext = os.path.splitext(file_name)
        if len(ext.encode()) > _MAX_EXT_BYTES:  # TemporaryFileUploadHandler makes it a file name suffix
            file_name = stem
        content_type, type_params = headers.get("content-type", ("", {}))
        try:
            length = int(headers.get("content-length", ("",))[0])
        except ValueError:
            length = None
        handlers = self._upload_handlers
        counters = [0] * len(handlers)
        try:
            for handler in handlers:
                try:
                    handler.new_file(field, file_name, content_type.strip(), length, type_params.get("charset"),
                                     type_params)
                except StopFutureHandlers:
                    break
            for chunk in _decoded(body, base64_encoded=_transfer_encoding(headers) == "base64"):
                for i, handler in enumerate(handlers):
                    size = len(chunk)
                    chunk = handler.receive_data_chunk(chunk, counters[i])
                    counters[i] += size
                    if chunk is None:
                        break
        except SkipFile:
            self._close_files()
            return "skipped by an upload handler"
        for i, handler in enumerate(handlers):
            file_obj = handler.file_complete(counters[i])
            if file_obj:
                file_obj.part, file_obj.raw_name = n, raw_name
                self._files.appendlist(field, file_obj)
                return None
        return "no upload handler kept it"


def _drain(stream) -> None:
    """Read what is left of a refused body and drop it, unparsed (a read costs the body's size and
    no more; ``stream`` stops at ``Content-Length``). gunicorn closes a keep-alive connection
    whose previous body has more than 64 KiB unread (``gunicorn/http/parser.py``
    ``_DRAIN_MAX_BYTES``) after answering ``Connection: keep-alive``: a client that reuses it then
    fails its next request."""
    try:
        while stream.read(1 << 16):
            pass
    except Exception:  # the client went away, or the stream cannot be read: nothing left to keep
        pass


#: Longest extension handed to the upload handlers: the temporary-file handler puts it in the file's
#: name (".upload" + extension), and a file name has at most 255 bytes (ext4, XFS, APFS).
_MAX_EXT_BYTES = 32


def _transfer_encoding(headers: dict) -> str | None:
    value = headers.get("content-transfer-encoding")
    return value[0].strip().lower() if value else None


def _decoded(body: LazyStream, *, base64_encoded: bool):
    """The part's body in chunks; base64 decoded in multiples of 4 characters (as Django does).

    Raises:
        MultiPartParserError: base64 that cannot be decoded, or is truncated.
    """
    if not base64_encoded:
        yield from body
        return
    remainder = b""
    for chunk in body:
        data = remainder + b"".join(chunk.split())
        aligned = len(data) // 4 * 4
        remainder = data[aligned:]
        if aligned:
            try:
                yield base64.b64decode(data[:aligned])
            except binascii.Error as e:
                raise MultiPartParserError("Could not decode base64 data.") from e
    if remainder:
        raise MultiPartParserError("Could not decode base64 data.")


def content_type_error(request) -> ApplicationError | None:
    """``malformed_request`` (400) when the request's ``Content-Type`` header cannot be parsed
    (``project.wsgi.Request.content_type_error``, or Django's parser raising on the header), else
    None. ``request``: a Django or DRF request."""
    problem = getattr(request, "content_type_error", None)
    if problem is None:
        try:
            parse_header_parameters(request.META.get("CONTENT_TYPE", ""))
        except ValueError as e:
            problem = str(e)
    if problem is None:
        return None
    return ApplicationError(f"the Content-Type header cannot be parsed: {problem}", code="malformed_request",
                            extra={"header": "Content-Type"})


class ContentNegotiation(DefaultContentNegotiation):
    """DRF's negotiation, except that a ``Content-Type`` whose parameters cannot be parsed is a 400
    ``malformed_request`` (DRF would treat it as matching no parser: 415), and an ``Accept`` header
    in which DRF finds no media type (empty, only commas, only over-long tokens) counts as absent:
    any type, as RFC 9110 §12.5.1 says of a request without one (DRF would answer 406).

    Raises:
        ApplicationError: ``malformed_request`` (400).
    """

    def get_accept_list(self, request):
        return super().get_accept_list(request) or ["*/*"]

    def select_parser(self, request, parsers):
        error = content_type_error(request)
        if error is not None:
            raise error
        return super().select_parser(request, parsers)


class AnyAccept(ContentNegotiation):
    """Negotiation that never refuses for ``Accept`` or ``?format=``, for views that answer one
    media type of their own whatever the client said it accepts: an export (and an error the JSON
    shape; DRF would answer 406 to ``Accept: application/vnd.apache.parquet``), a thumbnail
    (``Accept: image/webp``), the API docs page."""

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class DrfMultiPartParser(drf_parsers.BaseParser):
    """DRF parser for ``multipart/form-data`` using :class:`MultiPartParser`.

    Raises:
        ApplicationError: ``malformed_multipart`` (400) for a body that cannot be parsed, with
            ``extra.parts`` listing the first refused parts (:data:`LISTED_PARTS`) and
            ``extra.refused_count`` counting them all; ``too_many_parts`` (400) past
            :func:`max_parts` (``extra.value``), with the refused parts read before it.
    """

    media_type = "multipart/form-data"

    def parse(self, stream, media_type=None, parser_context=None):
        request = parser_context["request"]
        meta = request.META.copy()
        meta["CONTENT_TYPE"] = media_type
        try:
            data, files = MultiPartParser(meta, stream, request.upload_handlers,
                                          drf_parsers.get_encoding(parser_context)).parse()
        except TooManyParts as e:
            raise ApplicationError(f"the request has too many parts: {e}", code="too_many_parts",
                                   extra={"limit": "DATA_UPLOAD_MAX_NUMBER_FIELDS + DATA_UPLOAD_MAX_NUMBER_FILES",
                                          "value": e.limit, "parts": e.parts, "refused_count": e.count}) from e
        except RefusedParts as e:
            raise ApplicationError(f"the request has parts that cannot be used: {e}", code="malformed_multipart",
                                   extra={"parts": e.parts, "refused_count": e.count}) from e
        except (MultiPartParserError, SuspiciousMultipartForm) as e:  # the latter: Django's parser got stuck
            raise ApplicationError(f"the multipart body cannot be parsed: {e}", code="malformed_multipart",
                                   extra={"parts": [], "refused_count": 0}) from e
        return drf_parsers.DataAndFiles(data, files)


class JSONParser(drf_parsers.JSONParser):
    """DRF's JSON parser, the body then checked by ``json_input.checked``: depth bounded
    (``JSON_MAX_DEPTH``), strings only text.

    Raises:
        ParseError: ``parse_error`` (400): not JSON.
        ApplicationError: ``json_too_deep`` (400): nested deeper than ``JSON_MAX_DEPTH`` levels
            (``json`` raises ``RecursionError``, not the ``ValueError`` DRF turns into a 400, on
            ``[[[…]]]`` a few thousand levels deep); ``parse_error`` (400): an unpaired surrogate.
    """

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise json_input.too_deep() from None
        return json_input.checked(data)
