import django.db.models.deletion
import uuid
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name='Job',
            fields=[
                ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ('name', models.CharField(blank=True, max_length=200)),
                ('status', models.CharField(choices=[('queued', 'Queued'), ('running', 'Running'), ('paused', 'Paused'), ('cancelled', 'Cancelled'), ('done', 'Done')], default='queued', max_length=16)),
                ('priority', models.CharField(choices=[('urgent', 'Urgent'), ('background', 'Background')], default='background', max_length=16)),
                ('deadline', models.DateTimeField(blank=True, null=True)),
                ('model_id', models.CharField(max_length=200)),
                ('chunk_size', models.PositiveIntegerField(default=64)),
                ('total', models.PositiveIntegerField(default=0)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('started_at', models.DateTimeField(blank=True, null=True)),
                ('finished_at', models.DateTimeField(blank=True, null=True)),
                ('owner', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='jobs', to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'ordering': ('-created_at',),
            },
        ),
        migrations.CreateModel(
            name='BatchStat',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('lane', models.CharField(choices=[('interactive', 'Interactive'), ('bulk', 'Bulk')], max_length=16)),
                ('images', models.PositiveIntegerField()),
                ('failed', models.PositiveIntegerField(default=0)),
                ('load_ms', models.FloatField(default=0)),
                ('decode_ms', models.FloatField(default=0)),
                ('decode_wait_ms', models.FloatField(default=0)),
                ('preprocess_ms', models.FloatField(default=0)),
                ('embed_ms', models.FloatField(default=0)),
                ('upsert_ms', models.FloatField(blank=True, null=True)),
                ('total_ms', models.FloatField(default=0)),
                ('worker', models.CharField(blank=True, max_length=200)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('finished_at', models.DateTimeField(blank=True, null=True)),
                ('job', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='batches', to='embeddings.job')),
            ],
            options={
                'ordering': ('created_at',),
            },
        ),
        migrations.CreateModel(
            name='Image',
            fields=[
                ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ('lane', models.CharField(choices=[('interactive', 'Interactive'), ('bulk', 'Bulk')], max_length=16)),
                ('status', models.CharField(choices=[('queued', 'Queued'), ('embedded', 'Embedded'), ('skipped', 'Skipped'), ('failed', 'Failed'), ('expired', 'Expired'), ('cancelled', 'Cancelled')], default='queued', max_length=16)),
                ('reason', models.CharField(blank=True, help_text='stable reason code when not embedded', max_length=32)),
                ('reason_detail', models.TextField(blank=True)),
                ('sha256', models.CharField(max_length=64)),
                ('size_bytes', models.PositiveBigIntegerField()),
                ('storage_key', models.CharField(max_length=1024)),
                ('original_name', models.CharField(blank=True, max_length=255)),
                ('model_id', models.CharField(max_length=200)),
                ('point_id', models.UUIDField()),
                ('width', models.PositiveIntegerField(blank=True, null=True)),
                ('height', models.PositiveIntegerField(blank=True, null=True)),
                ('format', models.CharField(blank=True, max_length=16)),
                ('deadline', models.DateTimeField(blank=True, help_text='interactive only', null=True)),
                ('attempts', models.PositiveIntegerField(default=0)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('embedded_at', models.DateTimeField(blank=True, null=True)),
                ('duplicate_of', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='embeddings.image')),
                ('owner', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='images', to=settings.AUTH_USER_MODEL)),
                ('job', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='images', to='embeddings.job')),
            ],
            options={
                'ordering': ('created_at',),
                'indexes': [models.Index(fields=['owner', 'model_id', 'sha256'], name='embeddings__owner_i_f23d33_idx'), models.Index(fields=['job', 'status'], name='embeddings__job_id_4cd129_idx'), models.Index(fields=['point_id'], name='embeddings__point_i_b44c2e_idx')],
            },
        ),
    ]
