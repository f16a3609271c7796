import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('embeddings', '0004_image_one_original'),
    ]

    operations = [
        migrations.AddField(
            model_name='image',
            name='source',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='copies', to='embeddings.image'),
        ),
        migrations.AddField(
            model_name='job',
            name='kind',
            field=models.CharField(choices=[('ingest', 'Ingest'), ('migration', 'Migration')], default='ingest', max_length=16),
        ),
        migrations.CreateModel(
            name='EmbeddingSpace',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('model_id', models.CharField(max_length=200, unique=True)),
                ('model_name', models.CharField(max_length=100)),
                ('pretrained', models.CharField(max_length=1024)),
                ('seed', models.IntegerField(default=0)),
                ('precision', models.CharField(max_length=8)),
                ('collection', models.CharField(max_length=200)),
                ('dim', models.PositiveIntegerField()),
                ('state', models.CharField(choices=[('active', 'Active'), ('candidate', 'Candidate'), ('standby', 'Standby'), ('dropped', 'Dropped')], default='candidate', max_length=16)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('promoted_at', models.DateTimeField(blank=True, null=True)),
                ('dropped_at', models.DateTimeField(blank=True, null=True)),
                ('gate_report', models.JSONField(blank=True, default=dict)),
                ('cutoff_image', models.FloatField(blank=True, null=True)),
                ('cutoff_text', models.FloatField(blank=True, null=True)),
                ('calibration', models.JSONField(blank=True, default=dict)),
                ('job', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='embeddings.job')),
                ('source', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='embeddings.embeddingspace')),
            ],
            options={
                'ordering': ('created_at',),
                'constraints': [models.UniqueConstraint(condition=models.Q(('state', 'active')), fields=('state',), name='one_active_space')],
            },
        ),
    ]
