"""The screen: which vectors cannot be compared (NaN, infinity, all zeros) and why; and
:func:`poison`, the wrapped forward pass the pipeline's tests make broken vectors with."""
from __future__ import annotations

import numpy as np
import pytest

from workers import screen
from workers.errors import Reason

#: A text whose vector the wrapped text tower (:func:`poison`) gives as NaN.
NAN_TEXT = "an overflowing caption"


def poison(encoder, monkeypatch) -> None:
    """Wrap ``encoder``'s forward passes (the model's ``encode_image`` / ``encode_text``, before the
    encoder normalises): a row whose normalised input pixels average above 1.5 (all white: about 2.05
    with CLIP's mean and std) comes out +inf, as an fp16 overflow gives; one below -1.5 (all black:
    about -1.67) all zeros; a text tokenised as :data:`NAN_TEXT` NaN. Every other row is the real
    model's, computed in the same pass."""
    image_forward, text_forward = encoder.model.encode_image, encoder.model.encode_text
    nan_tokens = encoder.tokenizer([NAN_TEXT])

    def encode_image(x, *args, **kwargs):
        out = image_forward(x, *args, **kwargs).clone()
        mean = x.float().mean(dim=(1, 2, 3))
        out[mean > 1.5] = float("inf")
        out[mean < -1.5] = 0.0
        return out

    def encode_text(tokens, *args, **kwargs):
        out = text_forward(tokens, *args, **kwargs).clone()
        out[(tokens == nan_tokens.to(tokens.device)).all(dim=1)] = float("nan")
        return out

    monkeypatch.setattr(encoder.model, "encode_image", encode_image)
    monkeypatch.setattr(encoder.model, "encode_text", encode_text)


def test_each_row_gets_its_fault_or_none():
    good = np.full(8, 1 / np.sqrt(8), np.float32)
    rows = np.stack([good, np.r_[np.nan, good[1:]], np.r_[np.inf, good[1:]], np.r_[-np.inf, good[1:]],
                     np.zeros(8, np.float32), good * 1e-7, good * 1e-5, -good])
    assert screen.faults(rows) == [None, Reason.NON_FINITE_EMBEDDING, Reason.NON_FINITE_EMBEDDING,
                                   Reason.NON_FINITE_EMBEDDING, Reason.ZERO_EMBEDDING, Reason.ZERO_EMBEDDING,
                                   None, None]
    assert screen.faults(np.empty((0, 8), np.float32)) == []
    assert screen.fault(good) is None and screen.usable(good) and not screen.usable(np.zeros(8))


def test_require_usable_names_what_and_why():
    with pytest.raises(screen.UnusableVector) as e:
        screen.require_usable(np.full(4, np.nan, np.float32), "query vector")
    assert e.value.reason is Reason.NON_FINITE_EMBEDDING and str(e.value) == "query vector: non_finite_embedding"
    assert isinstance(e.value, ValueError)
    with pytest.raises(screen.UnusableVector, match="zero_embedding"):
        screen.require_usable(np.zeros(4, np.float32))
    screen.require_usable(np.ones(4, np.float32))


def test_the_normalised_encoder_output_of_an_overflow_or_a_dead_pass_is_refused(encoder, monkeypatch):
    # what the encoder hands on: +inf normalises to NaN, zeros stay zeros (the clamp), both refused
    import cv2
    import torch

    poison(encoder, monkeypatch)
    white, black = np.full((224, 224, 3), 255, np.uint8), np.zeros((224, 224, 3), np.uint8)
    grey = cv2.GaussianBlur(np.random.default_rng(0).integers(0, 255, (224, 224, 3), dtype=np.uint8), (0, 0), 8)
    from workers.preprocess import normalize

    pixels = torch.from_numpy(np.stack([white, grey, black])).permute(0, 3, 1, 2).contiguous()
    vectors = encoder.encode_images(normalize(pixels, encoder.preprocess_config))
    assert np.isnan(vectors[0]).all() and (vectors[2] == 0).all()
    assert abs(np.linalg.norm(vectors[1]) - 1) < 1e-5
    assert screen.faults(vectors) == [Reason.NON_FINITE_EMBEDDING, None, Reason.ZERO_EMBEDDING]
    texts = encoder.encode_texts(["a cat", NAN_TEXT])
    assert screen.faults(texts) == [None, Reason.NON_FINITE_EMBEDDING]
