"""``python manage.py reconcile``: one reconciler round now (the vectors worker runs them every
``RECONCILE_INTERVAL_S``); ``--loop`` keeps going, for deployments that run it as its own process."""
from __future__ import annotations

import time

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import close_old_connections

from embeddings.services.reconcile import reconcile_once


class Command(BaseCommand):
    help = ("Find queued images that no live message will finish (broker restarted, worker killed) and queue "
            "them again, or expire interactive ones past their deadline. Safe to run at any time.")

    def add_arguments(self, parser):
        parser.add_argument("--grace", type=float, default=None,
                            help=f"seconds before a queued image may be lost (default RECONCILE_GRACE_S, "
                                 f"{settings.RECONCILE_GRACE_S})")
        parser.add_argument("--loop", action="store_true", help="repeat every RECONCILE_INTERVAL_S until stopped")

    def handle(self, *args, grace, loop, **opts):
        while True:
            report = reconcile_once(grace_s=grace)
            self.stdout.write("another round is running" if report is None else str(report))
            if not loop:
                return
            close_old_connections()
            time.sleep(settings.RECONCILE_INTERVAL_S or 30)
