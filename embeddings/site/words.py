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
}
REASON_WORDS = {str(k): v for k, v in REASON_WORDS.items()}


def reason_words(code: str | None) -> str:
    """A sentence for ``code`` ("" for none; the code itself when there is no sentence for it)."""
    if not code:
        return ""
    return REASON_WORDS.get(code, code.replace("_", " ").capitalize() + ".")
