"""Services write, selectors read (HackSoftware Django-Styleguide); views and tasks call these.

Two wings and the entry points above them: ``catalogue/`` (sources, images, jobs, copies in other
spaces), ``lifecycle/`` (model migrations, quality gate, cutoff; it uses the catalogue, never the
other way), and per request: ``upload``, ``search``, ``pipeline`` (chunks, interactive batches,
queries, points), ``reconcile``, with ``waiting`` beneath them.
"""
