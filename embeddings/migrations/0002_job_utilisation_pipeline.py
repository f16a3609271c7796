from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('embeddings', '0001_initial'),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='pipeline',
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.AddField(
            model_name='job',
            name='utilisation',
            field=models.JSONField(blank=True, default=dict),
        ),
    ]
