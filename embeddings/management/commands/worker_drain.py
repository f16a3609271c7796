"""``python manage.py worker_drain --name bulk``: a pod's ``preStop`` for a Celery worker (see
``embeddings.services.drain``). Stops the worker ``<name>@<this host>`` consuming, waits until it
runs no task (at most ``WORKER_DRAIN_S``), and exits 0 either way: SIGTERM follows, and its soft
shutdown bounds what is left."""
from __future__ import annotations

import json
import socket

from django.conf import settings
from django.core.management.base import BaseCommand

from embeddings.services.drain import worker_drain


class Command(BaseCommand):
    help = "Stop a worker of this host taking messages and wait for its tasks in flight (a pod's preStop)."

    def add_arguments(self, parser):
        parser.add_argument("--name", required=True,
                            help="the worker's name before @ (`-n bulk@%%h`: bulk); the host is this one's")
        parser.add_argument("--wait", type=float, default=None,
                            help=f"seconds to wait for its tasks (default WORKER_DRAIN_S, {settings.WORKER_DRAIN_S:g})")

    def handle(self, *args, name, wait, **opts):
        wait_s = settings.WORKER_DRAIN_S if wait is None else wait
        report = worker_drain(node=f"{name}@{socket.gethostname()}", wait_s=wait_s)
        self.stdout.write(json.dumps(report))
