from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('embeddings', '0005_embedding_spaces'),
    ]

    operations = [
        migrations.AddField(
            model_name='embeddingspace',
            name='demoted_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
