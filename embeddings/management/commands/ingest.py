"""``python manage.py ingest FOLDER``: queue a bulk job from a folder and show progress until done."""
from __future__ import annotations

import time

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from embeddings.models import Job, JobPriority, JobStatus
from embeddings.services.catalogue import jobs as job_services
from embeddings.errors import ApplicationError
from embeddings.services.catalogue.sources import from_folder
from workers.timing import STAGES


class Command(BaseCommand):
    help = "Queue every file under FOLDER as a bulk embedding job and wait for it, with a progress bar."

    def add_arguments(self, parser):
        parser.add_argument("folder")
        parser.add_argument("--user", default="ingest", help="owner of the job (created if missing)")
        parser.add_argument("--name", default="")
        parser.add_argument("--priority", choices=JobPriority.values, default=JobPriority.BACKGROUND)
        parser.add_argument("--timeout", type=float, default=3600, help="seconds to wait before giving up")
        parser.add_argument("--no-wait", action="store_true", help="queue the job and return")

    def handle(self, *args, **opts):
        owner, _ = get_user_model().objects.get_or_create(username=opts["user"])
        try:
            sources = from_folder(opts["folder"], roots=None)  # the server's own operator: any folder
        except ApplicationError as e:
            raise CommandError(e.message) from e
        t0 = time.perf_counter()
        job = job_services.job_create(owner=owner, sources=sources, name=opts["name"] or opts["folder"],
                                      priority=opts["priority"])
        self.stdout.write(f"job {job.id}: {job.total} files queued in {time.perf_counter() - t0:.1f} s")
        if opts["no_wait"]:
            return
        deadline = time.monotonic() + opts["timeout"]
        with tqdm(total=job.total, unit="img", desc="embedding", disable=None) as bar:
            while True:
                job = Job.objects.get(id=job.id)
                p = job_services.job_progress(job)
                bar.n = p["finished"]
                bar.set_postfix(embedded=p["embedded"], skipped=p["skipped"], failed=p["failed"])
                bar.refresh()
                if job.status in (JobStatus.DONE, JobStatus.CANCELLED):
                    break
                if time.monotonic() > deadline:
                    raise CommandError(f"job {job.id} not done after {opts['timeout']} s: {p['counts']}")
                time.sleep(0.5)
        wall = time.perf_counter() - t0
        self.stdout.write(self.format_summary(job, p, wall))

    @staticmethod
    def format_summary(job: Job, p: dict, wall: float) -> str:
        """The job's counts, throughput and per-stage timing table as text."""
        lines = [
            f"job {job.id} {job.status}: {p['embedded']} embedded, {p['skipped']} skipped, {p['failed']} failed "
            f"of {job.total} in {wall:.1f} s ({(p['embedded'] + p['skipped']) / wall:.2f} images/s end to end; "
            f"{p['throughput_images_per_s'] or 0:.2f} images/s while running)",
        ]
        for f in p["failures"]:
            lines.append(f"  failed: {f['original_name']}: {f['reason']} ({f['reason_detail'][:100]})")
        if p["timings_ms"]:
            lines.append(f"stage timings over {p['batches']} batches (ms per batch; per_image = sum / images):")
            lines.append(f"  {'stage':<12}{'min':>10}{'avg':>10}{'max':>10}{'p95':>10}{'per_image':>11}")
            for stage in STAGES:
                v = p["timings_ms"].get(stage)
                if v:
                    lines.append(f"  {stage:<12}{v['min']:>10.1f}{v['avg']:>10.1f}{v['max']:>10.1f}{v['p95']:>10.1f}"
                                 f"{v['per_image_avg']:>11.2f}")
        return "\n".join(lines)
