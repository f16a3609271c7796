"""Services write, selectors read (HackSoftware Django-Styleguide); views and tasks call these.

One wing (a package) per feature; no two wings import each other, directly or round a circle
(``tests/test_import_direction.py``):

- ``catalogue/``: sources, images, jobs, manifests, catalogues read and fetched, copies in other spaces.
- ``lifecycle/``: model migrations, the quality gate that guards a promotion, score cutoffs.
- ``duplicates/``: near-duplicate groups: calibration, scan, groups, review.
- ``webhooks/``: signed webhooks: endpoints, events (emitted by the catalogue and the lifecycle), delivery.
- ``exports/``: vector exports: which rows, a page at a time, and the files they are written into.
- ``interactive/``: the interactive door: upload, search, examples, embed, and the wait beneath them.
- ``access/``: API keys (made, checked, revoked, migrated from DRF tokens), scopes and per-key limits.
- ``queues/``: the worker side of each queue (chunks, interactive batches, queries, points).

Loose modules are what several wings share: ``reconcile`` (the reconciler's rounds) and
``vectors`` (the stored vectors of a page of image rows).
"""
