import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("embeddings", "0012_bulk_chunk_scheduler"),
    ]

    operations = [
        migrations.AddField(
            model_name="batchpart",
            name="leased_at",
            field=models.DateTimeField(default=django.utils.timezone.now),
        ),
    ]
