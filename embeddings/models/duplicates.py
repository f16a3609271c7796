"""Duplicate scans, the edges and groups they find, and pairs an owner marked as not duplicates."""
from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models

from .catalogue import Image


class DuplicateKind(models.TextChoices):
    """``exact``: the same bytes (sha256) uploaded more than once; ``near``: different bytes whose
    vectors are within the owner's threshold (re-encoded, resized, cropped copies)."""

    EXACT = "exact"
    NEAR = "near"


class GroupStatus(models.TextChoices):
    """A group's review: ``open`` (nobody decided), ``resolved`` (one kept, the rest deleted),
    ``dismissed`` (a person said "not duplicates": its pairs never group again)."""

    OPEN = "open"
    RESOLVED = "resolved"
    DISMISSED = "dismissed"


class ScanState(models.TextChoices):
    CALIBRATING = "calibrating"
    SCANNING = "scanning"
    DONE = "done"
    FAILED = "failed"


class DuplicateScan(models.Model):
    """The near-duplicate scan of one owner's images in one embedding space
    (``services.duplicates``): its threshold and how it was calibrated, progress, timings. One row
    per owner and space; a new scan replaces the previous one's open groups. Once ``done``, images
    embedded later are grouped incrementally at its threshold."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="duplicate_scans")
    model_id = models.CharField(max_length=200)
    state = models.CharField(max_length=16, choices=ScanState.choices, default=ScanState.CALIBRATING)
    #: The cosine at or above which two images are near-duplicates (None while calibrating).
    threshold = models.FloatField(null=True, blank=True)
    #: ``workers.duplicates.calibrate``'s report, or ``{"source": "given"}`` for a threshold set by the caller.
    calibration = models.JSONField(default=dict, blank=True)
    #: A unique token of the running scan: a slice task of an older scan sees another and stops.
    run = models.CharField(max_length=32, blank=True, default="")
    scanned = models.PositiveIntegerField(default=0)
    edges = models.PositiveIntegerField(default=0)
    groups = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True, default="")
    started_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    duration_s = models.FloatField(null=True, blank=True)
    #: Seconds inside the store's neighbour queries, summed over the slices.
    query_s = models.FloatField(default=0)
    #: When the owner's exact groups were last regrouped from the database (``scan.refresh_exact``).
    exact_checked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["owner", "model_id"], name="duplicate_scan_one_per_space")]

    def __str__(self) -> str:
        return f"duplicates of {self.owner_id} in {self.model_id} ({self.state})"


class DuplicateEdge(models.Model):
    """A scan's working set: one pair of points above the threshold, found by a slice; read by the
    scan's last step to build groups, then deleted."""

    scan = models.ForeignKey(DuplicateScan, on_delete=models.CASCADE, related_name="+")
    a = models.UUIDField()
    b = models.UUIDField()
    score = models.FloatField()


class DuplicateGroup(models.Model):
    """A group of one owner's images that are copies of each other, exact or near, in one space."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="duplicate_groups")
    model_id = models.CharField(max_length=200)
    kind = models.CharField(max_length=8, choices=DuplicateKind.choices)
    status = models.CharField(max_length=16, choices=GroupStatus.choices, default=GroupStatus.OPEN)
    #: The threshold the group was formed at (1.0 for exact copies).
    threshold = models.FloatField()
    #: The kept image once resolved.
    kept = models.ForeignKey(Image, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    reviewed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("-created_at",)
        indexes = [models.Index(fields=["owner", "model_id", "status"])]

    def __str__(self) -> str:
        return f"{self.kind} group {self.id} ({self.status})"


class DuplicateMember(models.Model):
    """One image of a group, with its cosine to the group's representative (1.0 for the
    representative and for exact copies)."""

    group = models.ForeignKey(DuplicateGroup, on_delete=models.CASCADE, related_name="members")
    image = models.ForeignKey(Image, on_delete=models.CASCADE, related_name="+")
    point_id = models.UUIDField(null=True, blank=True)
    score = models.FloatField()
    representative = models.BooleanField(default=False)

    class Meta:
        ordering = ("-representative", "-score")
        constraints = [models.UniqueConstraint(fields=["group", "image"], name="duplicate_member_once")]


class NotDuplicate(models.Model):
    """A person's "not duplicates" for two pictures of one owner, by their bytes (sha256, in
    sorted order), so it holds in every embedding space and after a re-scan."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    sha_a = models.CharField(max_length=64)
    sha_b = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["owner", "sha_a", "sha_b"], name="not_duplicate_once")]
