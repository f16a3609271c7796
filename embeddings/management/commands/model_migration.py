"""``python manage.py model_migration start|status|gate|promote|rollback|drop``: change the model without
downtime (issue 13, docs/operations.md "Changing the model"). The same services as ``/api/migrations/``.

    model_migration start --model ViT-S-32 --pretrained random [--precision fp32] [--seed 0] [--owner admin]
    model_migration status [SPACE]           # every space, or one (id or model id), with its job's progress
    model_migration gate SPACE               # run the quality gate (and the cutoff calibration) again
    model_migration promote SPACE [--force]  # make it active (the gate must pass unless --force)
    model_migration rollback                 # promote the standby that was active before
    model_migration drop SPACE               # delete a non-active space's collection and copies
"""
from __future__ import annotations

import json

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from embeddings.api.model_migrations import migration_view
from embeddings.errors import ApplicationError
from embeddings.models import EmbeddingSpace
from embeddings.services.lifecycle import gate
from embeddings.services.lifecycle import model_migrations as migrations


def _space(ref: str) -> EmbeddingSpace:
    """A space by id or by model id."""
    qs = EmbeddingSpace.objects.filter(pk=int(ref)) if ref.isdigit() else EmbeddingSpace.objects.filter(model_id=ref)
    space = qs.first()
    if space is None:
        raise CommandError(f"no embedding space {ref!r} (model_migration status lists them)")
    return space


class Command(BaseCommand):
    help = "Change the embedding model without downtime: start, status, promote, rollback, drop."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        start = sub.add_parser("start", help="re-embed the catalogue with another model (a candidate space)")
        start.add_argument("--model", required=True, help="open_clip architecture, e.g. ViT-S-32")
        start.add_argument("--pretrained", default="random", help="tag, checkpoint file path, or random")
        start.add_argument("--precision", default=None, help="fp32, bf16, fp16 (default CLIP_PRECISION)")
        start.add_argument("--seed", type=int, default=None, help="random weights' seed (default CLIP_SEED)")
        start.add_argument("--owner", default=None, help="the staff user owning the job (default: the first superuser)")
        start.add_argument("--here", action="store_true", help="create the copies in this process instead of a task")
        status = sub.add_parser("status", help="every space, or one, with its migration job's progress")
        status.add_argument("space", nargs="?", help="space id or model id")
        gate = sub.add_parser("gate", help="run the quality gate and the cutoff calibration of a space again")
        gate.add_argument("space")
        promote = sub.add_parser("promote", help="make a space the active one")
        promote.add_argument("space")
        promote.add_argument("--force", action="store_true", help="past a refusing (or missing) quality gate")
        sub.add_parser("rollback", help="promote the standby space that was active most recently")
        drop = sub.add_parser("drop", help="delete a non-active space's collection and copy rows")
        drop.add_argument("space")

    def handle(self, *args, action, **opts):

        try:
            if action == "start":
                users = get_user_model().objects
                owner = (users.get(username=opts["owner"]) if opts["owner"]
                         else users.filter(is_superuser=True).order_by("id").first())
                if owner is None:
                    raise CommandError("no owner: pass --owner NAME (manage.py apiuser NAME --staff makes one)")
                space = migrations.migration_start(owner=owner, model_name=opts["model"],
                                                   pretrained=opts["pretrained"], precision=opts["precision"],
                                                   seed=opts["seed"], fill=not opts["here"])
                if opts["here"]:
                    migrations.migration_fill(space_id=space.id)
                out = migration_view(EmbeddingSpace.objects.get(pk=space.pk))
            elif action == "status":
                spaces = [_space(opts["space"])] if opts.get("space") else list(EmbeddingSpace.objects.all())
                out = [migration_view(s) for s in spaces]
            elif action == "gate":

                space = _space(opts["space"])
                gate.gate_start(space.id)
                out = migration_view(space)
            elif action == "promote":
                out = migration_view(migrations.promote(_space(opts["space"]), force=opts["force"], by="manage.py"))
            elif action == "rollback":
                out = migration_view(migrations.rollback(by="manage.py"))
            else:
                out = migration_view(migrations.space_drop(_space(opts["space"])))
        except ApplicationError as e:
            raise CommandError(f"{e.code}: {e}") from e
        self.stdout.write(json.dumps(out, indent=2, default=str))
