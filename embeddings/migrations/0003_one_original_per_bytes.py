# Written by hand (issue 9): the data step before 0004's constraint. A separate migration because
# PostgreSQL refuses CREATE INDEX in a transaction with pending (deferred foreign key) trigger events.

from django.db import migrations, models

LIVE = ("queued", "embedded")


def one_original_per_bytes(apps, schema_editor):
    """Before the constraint: where concurrent uploads made several originals of the same owner,
    model and bytes, keep one (an embedded one first, then the oldest) and make the others its
    skipped duplicates (they share its point: uuid5(model, sha256)); give skipped rows their
    original's width, height and format."""
    Image = apps.get_model("embeddings", "Image")
    groups = (Image.objects.filter(status__in=LIVE, duplicate_of__isnull=True)
              .values("owner_id", "model_id", "sha256").annotate(n=models.Count("id")).filter(n__gt=1))
    for g in groups:
        rows = list(Image.objects.filter(status__in=LIVE, duplicate_of__isnull=True, owner_id=g["owner_id"],
                                         model_id=g["model_id"], sha256=g["sha256"])
                    .order_by("created_at", "id"))
        keep = next((r for r in rows if r.status == "embedded"), rows[0])
        demoted = [r.id for r in rows if r.id != keep.id]
        Image.objects.filter(id__in=demoted).update(status="skipped", duplicate_of=keep, reason="", reason_detail="")
        Image.objects.filter(duplicate_of_id__in=demoted).update(duplicate_of=keep)
    for dup in Image.objects.filter(status="skipped", duplicate_of__status="embedded", width__isnull=True):
        original = dup.duplicate_of
        Image.objects.filter(id=dup.id).update(width=original.width, height=original.height, format=original.format)


class Migration(migrations.Migration):

    dependencies = [
        ('embeddings', '0002_job_utilisation_pipeline'),
    ]

    operations = [
        migrations.RunPython(one_original_per_bytes, migrations.RunPython.noop),
    ]
