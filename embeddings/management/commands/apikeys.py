"""``python manage.py apikeys``: API keys from the command line (docs/api-keys.md).

    manage.py apikeys migrate-tokens          # every DRF token → a key of the same secret; plaintext rows deleted
    manage.py apikeys create NAME [--scopes all,...] [--label L] [--limit requests_per_minute=600 ...]
                                              [--limit bulk_weight=2]
                                              # prints the secret, once
    manage.py apikeys list [NAME]
    manage.py apikeys revoke PREFIX
"""
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from embeddings.errors import ApplicationError
from embeddings.models import ApiKey
from embeddings.services.access import keys as key_services


class Command(BaseCommand):
    help = "Migrate DRF tokens to API keys; create, list and revoke keys."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        sub.add_parser("migrate-tokens", help="turn every DRF authtoken token into an API key of the same secret "
                                              "(scopes all; staff: and admin) and delete the plaintext rows")
        create = sub.add_parser("create", help="make a key for a user and print its secret (shown once)")
        create.add_argument("username")
        create.add_argument("--scopes", default="all", help="comma-separated scopes and presets (default: all)")
        create.add_argument("--label", default="cli", help="the key's name")
        create.add_argument("--limit", action="append", default=[], metavar="NAME=N",
                            help="a limit of the key (requests_per_minute, images_per_minute, bulk_images_per_day, "
                                 "concurrent_bulk_jobs: whole numbers; bulk_weight: 0.01 to 100), repeatable")
        listing = sub.add_parser("list", help="keys (prefix, owner, name, state, scopes); never a secret")
        listing.add_argument("username", nargs="?")
        revoke = sub.add_parser("revoke", help="revoke the key with this prefix (ck_...)")
        revoke.add_argument("prefix")

    def handle(self, *args, action, **opts):
        if action == "migrate-tokens":
            made = key_services.tokens_migrate()
            for key in made:
                self.stdout.write(f"{key.prefix} {key.owner.get_username()} ({','.join(key.scopes)})")
            self.stdout.write(f"{len(made)} tokens migrated to API keys; no plaintext token is left")
        elif action == "create":
            user = get_user_model().objects.filter(username=opts["username"]).first()
            if user is None:
                raise CommandError(f"no user {opts['username']!r}")
            scopes = [s.strip() for s in opts["scopes"].split(",") if s.strip()]
            limits = {}
            for item in opts["limit"]:
                name, _, value = item.partition("=")
                try:
                    limits[name.strip()] = int(value)
                except ValueError:
                    try:  # bulk_weight takes fractions; the service refuses them for the counted limits
                        limits[name.strip()] = float(value)
                    except ValueError:
                        raise CommandError(f"--limit {item!r}: NAME=N, N a number") from None
            try:
                made = key_services.key_create(owner=user, name=opts["label"], scopes=scopes, limits=limits,
                                               by_staff=True)
            except ApplicationError as e:
                raise CommandError(e.message) from e
            self.stdout.write(made.secret)
        elif action == "list":
            keys = ApiKey.objects.select_related("owner").order_by("created_at")
            if opts.get("username"):
                keys = keys.filter(owner__username=opts["username"])
            for key in keys:
                self.stdout.write(f"{key.prefix}\t{key.owner.get_username()}\t{key.name}\t{key.state()}\t"
                                  f"{','.join(key.scopes)}")
        else:
            key = ApiKey.objects.filter(prefix=opts["prefix"]).first()
            if key is None:
                raise CommandError(f"no key {opts['prefix']!r}")
            key_services.key_revoke(key=key)
            self.stdout.write(f"{key.prefix} revoked")
