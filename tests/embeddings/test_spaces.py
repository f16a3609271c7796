"""The active embedding space (issue 13): created from the configured model, one active row, cached
for at most SPACE_CACHE_S."""
from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction

from embeddings.models import EmbeddingSpace, SpaceState
from embeddings import spaces


@pytest.fixture
def configured(settings, random_config):
    settings.PIPELINE = random_config
    settings.SPACE_CACHE_S = 0.5
    spaces.forget_cache()
    yield settings
    spaces.forget_cache()


@pytest.mark.django_db
def test_first_read_creates_the_configured_space_as_the_only_active_one(configured, random_config):
    space = spaces.active()
    assert (space.model_id, space.state) == ("ViT-B-32/random-seed0/fp32", SpaceState.ACTIVE)
    assert (space.collection, space.dim, space.pretrained, space.seed) == (
        "clip_vit_b_32_random_seed0_fp32", 512, "random", 0)
    assert spaces.active(fresh=True).pk == space.pk
    assert EmbeddingSpace.objects.count() == 1
    assert spaces.config_of(space) == random_config


@pytest.mark.django_db
def test_a_second_active_row_is_refused_by_the_database(configured):
    spaces.active()
    with pytest.raises(IntegrityError), transaction.atomic():
        EmbeddingSpace.objects.create(model_id="ViT-B-16/random-seed0/fp32", model_name="ViT-B-16", pretrained="random",
                                      precision="fp32", collection="c", dim=512, state=SpaceState.ACTIVE)


@pytest.mark.django_db
def test_the_cached_row_is_used_until_it_is_older_than_space_cache_s(configured, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(spaces.time, "monotonic", lambda: clock[0])
    first = spaces.active()
    EmbeddingSpace.objects.filter(pk=first.pk).update(state=SpaceState.STANDBY)
    other = EmbeddingSpace.objects.create(model_id="ViT-B-16/random-seed0/fp32", model_name="ViT-B-16",
                                          pretrained="random", precision="fp32", collection="c", dim=512,
                                          state=SpaceState.ACTIVE)
    clock[0] += 0.4
    assert spaces.active().pk == first.pk  # cached
    clock[0] += 0.2
    assert spaces.active().pk == other.pk  # 0.6 s > SPACE_CACHE_S
    assert [s.model_id for s in spaces.dual_targets()] == [first.model_id]


@pytest.mark.django_db
def test_a_duplicate_of_a_re_embedded_copy_names_the_users_own_image(user):
    """After a switch, a re-upload's original can be a copy row (``source`` set); users see their row."""
    from embeddings.api.images import ImageSerializer
    from embeddings.models import Image, ImageStatus

    def row(**kw):
        return Image.objects.create(owner=user, lane="bulk", sha256="ab" * 32, size_bytes=3, storage_key="blob/x",
                                    point_id="00000000-0000-0000-0000-000000000001", **kw)

    mine = row(model_id="A", status=ImageStatus.EMBEDDED)
    copy = row(model_id="M", status=ImageStatus.EMBEDDED, source=mine)
    again = row(model_id="M", status=ImageStatus.SKIPPED, duplicate_of=copy)
    plain = row(model_id="A", status=ImageStatus.SKIPPED, duplicate_of=mine)
    assert ImageSerializer(again).data["duplicate_of"] == mine.id
    assert ImageSerializer(plain).data["duplicate_of"] == mine.id
    assert ImageSerializer(mine).data["duplicate_of"] is None
