"""``python manage.py store_migrate``: copy a qdrant-client local-mode folder (the embedded store
before qdrant-edge) into the configured vector store, verify the copy, and leave the source as it is.

Stop the vectors worker first: both embedded stores allow one process per folder, and the command
says so if either is taken. Run it again at any time: writes are idempotent per point id.
"""
from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from workers.model_config import embed_dim
from workers.vector_store import open_store
from workers.vector_store.migrate import CopyMismatch, copy_store


class Command(BaseCommand):
    help = ("Copy the points of a qdrant-client local-mode folder into the configured vector store "
            "(VECTOR_STORE, edge by default), verify counts and a sample of vectors; never deletes the source.")

    def add_arguments(self, parser):
        parser.add_argument("--source", default=str(Path(settings.VAR_DIR) / "qdrant"),
                            help="local-mode folder to copy from (default: $VAR_DIR/qdrant)")
        parser.add_argument("--collection", default=None,
                            help="collection to copy (default: this embedding space's, PipelineConfig.collection_name)")
        parser.add_argument("--sample", type=int, default=1000, help="points whose vector and payload are compared")

    def handle(self, *args, source, collection, sample, **opts):

        cfg = settings.PIPELINE
        collection = collection or cfg.collection_name
        src_dir = Path(source).resolve()
        if settings.VECTOR_STORE == "local" and src_dir == Path(settings.QDRANT_PATH).resolve():
            raise CommandError("the source is the configured store itself: set VECTOR_STORE=edge (or server) first")
        if not (src_dir / "meta.json").exists():
            raise CommandError(f"{src_dir} is not a qdrant-client local-mode folder (no meta.json)")
        try:
            src = open_store("local", collection=collection, dim=embed_dim(cfg.model_name), path=str(src_dir))
        except RuntimeError as e:
            raise CommandError(f"cannot open the source (is a worker still running on it?): {e}") from e
        try:
            if not src.client.collection_exists(collection):
                names = [c.name for c in src.client.get_collections().collections]
                raise CommandError(f"no collection {collection!r} in {src_dir}; it has: {', '.join(names) or 'none'}")
            dim = src.client.get_collection(collection).config.params.vectors.size
            dst = open_store(settings.VECTOR_STORE, collection=collection, dim=dim, url=settings.QDRANT_URL or None,
                             path=settings.QDRANT_PATH, fsync=False)
            try:
                dst.ensure_collection()
            except OSError as e:
                raise CommandError(f"cannot open the target (stop the vectors worker first): {e}") from e
            total = src.count()
            self.stdout.write(f"copying {total} points of {collection!r} from {src_dir} to the {dst.kind} store")
            try:
                report = copy_store(src, dst, sample=sample, progress=lambda n: self.stdout.write(
                    f"\r  {n}/{total}", ending=""))
            except CopyMismatch as e:
                raise CommandError(f"the copy does not match its source (the source is untouched): {e}") from e
            finally:
                dst.close()  # flushes the copy to disk
        finally:
            src.close()
        self.stdout.write("")
        self.stdout.write(self.style.SUCCESS(
            f"copied {report.source_points} points in {report.seconds:.1f} s; the target holds "
            f"{report.target_points}; {report.sampled} sampled vectors and payloads match; source kept at {src_dir}"))
        if report.unusable:  # NaN, infinity or zeros: written before the screen, never found by a search
            self.stdout.write(self.style.WARNING(
                f"{len(report.unusable)} points not copied: their vector is not finite or is all zeros "
                f"(e.g. {report.unusable[0]}); re-embed their images"))
