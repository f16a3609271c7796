"""``python manage.py apiuser NAME [--staff]``: create (or reuse) a user and print its API token."""
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from rest_framework.authtoken.models import Token


class Command(BaseCommand):
    help = "Create or reuse a user and print its API token (for scripts and demos)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--staff", action="store_true", help="make the user staff and superuser")

    def handle(self, *args, username, staff, **opts):
        user, _ = get_user_model().objects.get_or_create(username=username)
        if staff and not user.is_staff:
            user.is_staff = user.is_superuser = True
            user.save(update_fields=["is_staff", "is_superuser"])
        token, _ = Token.objects.get_or_create(user=user)
        self.stdout.write(token.key)
