from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('embeddings', '0003_one_original_per_bytes'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddConstraint(
            model_name='image',
            constraint=models.UniqueConstraint(condition=models.Q(('duplicate_of__isnull', True), ('status__in', ('queued', 'embedded'))), fields=('owner', 'model_id', 'sha256'), name='image_one_original'),
        ),
    ]
