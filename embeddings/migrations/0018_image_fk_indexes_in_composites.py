"""The single-column indexes of ``embeddings_image.owner_id`` and ``job_id`` dropped: the composite
indexes that lead with each serve every look-up and cascade by it, and every insert and mark wrote
them too. Only the indexes go: the foreign keys stay as they are (Django's ``AlterField`` would drop
and re-add each constraint, a scan of the whole table under a lock on PostgreSQL). The names are
the ones Django gave them (table, column and a hash of both), the same on SQLite and PostgreSQL.
"""
import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

INDEXES = {"job": "embeddings_image_job_id_e8348c9d", "owner": "embeddings_image_owner_id_60227744"}


class Migration(migrations.Migration):

    dependencies = [
        ('embeddings', '0017_api_key_bulk_weight'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(f'DROP INDEX IF EXISTS "{name}"',
                                  reverse_sql=f'CREATE INDEX IF NOT EXISTS "{name}" ON "embeddings_image" ("{column}_id")')
                for column, name in INDEXES.items()
            ],
            state_operations=[
                migrations.AlterField(
                    model_name='image',
                    name='job',
                    field=models.ForeignKey(blank=True, db_index=False, null=True,
                                            on_delete=django.db.models.deletion.CASCADE, related_name='images',
                                            to='embeddings.job'),
                ),
                migrations.AlterField(
                    model_name='image',
                    name='owner',
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE,
                                            related_name='images', to=settings.AUTH_USER_MODEL),
                ),
            ],
        ),
    ]
