"""Reason codes in words, for people (the API keeps the codes; ``workers.errors.Reason`` lists them)."""
from __future__ import annotations

from workers.errors import Reason

#: ``{code: sentence}`` for every image refusal and the request errors a page can meet.
REASON_WORDS: dict[str, str] = {
    Reason.EMPTY: "The file is empty.",
    Reason.NOT_AN_IMAGE: "This file is not an image.",
    Reason.UNSUPPORTED_FORMAT: "This image format cannot be read here.",
    Reason.TRUNCATED: "The file is cut short: part of the image is missing.",
    Reason.CORRUPT: "The image data is damaged.",
    Reason.TOO_LARGE: "The file is larger than the size limit.",
    Reason.TOO_MANY_PIXELS: "The picture has more pixels than the limit.",
    Reason.DECODE_TIMEOUT: "Reading this image took too long.",
    Reason.SOURCE_MISSING: "The stored file is gone.",
    Reason.SOURCE_CHANGED: "The stored file changed after it was added.",
    Reason.EXPIRED: "It was not done before its deadline.",
    Reason.CANCELLED: "Its job was cancelled.",
    Reason.ATTEMPTS_EXHAUSTED: "It failed too many times and was given up.",
    "overloaded": "The service is busy right now; try again in a few seconds.",
    "not_embedded": "This image is not embedded yet.",
    "not_found": "There is no such image or job (or it is not yours).",
    "too_many_files": "Too many files in one request.",
    "deadline_exceeded": "The search did not finish in time.",
    "invalid_transition": "The job cannot do that in its current state.",
    # catalogue jobs (issue 41): fetching a row's image
    Reason.FETCH_TIMEOUT: "Its address took too long to answer.",
    Reason.FETCH_STATUS: "Its address answered with an error status.",
    Reason.FETCH_TOO_LARGE: "Its address sent more than the size limit.",
    Reason.FETCH_REFUSED_ADDRESS: "Its address is on a private network this service may not reach.",
    Reason.FETCH_TLS: "Its address's secure connection could not be trusted.",
    Reason.FETCH_CONNECT: "Its address could not be reached, or the connection broke.",
    Reason.FETCH_REDIRECTS: "Its address redirected too often, or nowhere.",
    Reason.FETCH_INVALID_URL: "It is not an http or https address this service can fetch.",
    # a manifest's rows
    "url_invalid": "The row's url is not a usable http or https address.",
    "key_invalid": "The row's object key cannot be used.",
    "row_invalid": "The row cannot be read.",
    "row_encoding": "The row is not UTF-8 text.",
    "row_too_long": "The row is longer than the line limit.",
    "source_missing_column": "The row needs exactly one of url and key.",
    "external_id_invalid": "The external id is not usable.",
    "external_id_repeated": "An earlier row already gave this external id.",
    "external_id_taken": "Another of your images already has this external id.",
    "metadata_invalid": "The metadata is not valid.",
    "metadata_too_large": "The metadata is larger than the limit.",
    "metadata_too_deep": "The metadata nests too deep.",
    "manifest_too_many_rows": "The manifest has more rows than the limit; the rest were not read.",
    # a manifest or a prefix as a whole
    "manifest_format": "This is not a CSV, JSON Lines or Parquet manifest.",
    "manifest_header": "The manifest's header cannot be used.",
    "manifest_encoding": "The manifest is not UTF-8 text.",
    "manifest_row_group_too_large": "A row group of this Parquet manifest is larger than the limit: "
                                    "write it with smaller row groups.",
    "source_uri_invalid": "That is not an s3://bucket/path address.",
    "source_not_allowed": "Jobs may not read that bucket or folder here.",
    "mixed_sources": "A job reads one source.",
    "invalid_filter": "The filter cannot be used.",
    # a search by examples (issue 45)
    "positive_required": "Tick at least one result you want more of: a search by examples needs a positive example.",
    "too_many_examples": "There are too many examples for one search: remove some.",
    "invalid_example": "An example cannot be used.",
    "invalid_query": "This search cannot be run as asked.",
    "vector_missing": "An image has no vector to search by.",
    Reason.ZERO_EMBEDDING: "The examples cancel each other out: there is nothing left to search by.",
    "invalid": "Some of the values are not valid.",
    # the usage page (docs/usage.md)
    "invalid_date": "A date must be written YYYY-MM-DD.",
    "usage_range_inverted": "The end is before the start: swap them.",
    "usage_range_too_long": "That range is longer than one report covers: choose fewer days.",
    "invalid_owner": "The owner is a user's id, or all.",
    # the request itself (embeddings.transport: the site's error page)
    "bad_request": "This request cannot be read.",
    "invalid_characters": "The address or a field holds a control character (such as NUL) that cannot be used.",
    "csrf_failed": "This form could not be verified: reload the page and send it again (cookies must be on).",
    "permission_denied": "You may not do this.",
    "method_not_allowed": "This page cannot be used that way.",
    "length_required": "The upload did not say its length.",
    "request_too_large": "What was sent is larger than the limit.",
    "too_many_fields": "The form has more fields than the limit.",
    "internal_error": "Something went wrong on our side; it has been logged.",
}
REASON_WORDS = {str(k): v for k, v in REASON_WORDS.items()}


def reason_words(code: str | None) -> str:
    """A sentence for ``code`` ("" for none; the code itself when there is no sentence for it)."""
    if not code:
        return ""
    return REASON_WORDS.get(code, code.replace("_", " ").capitalize() + ".")
