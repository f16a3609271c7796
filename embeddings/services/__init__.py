"""Services write, selectors read (HackSoftware Django-Styleguide); views and tasks call these.

Two wings and the entry points above them: ``catalogue/`` (sources, images, jobs, copies in other
spaces), ``lifecycle/`` (model migrations, quality gate, cutoff; it uses the catalogue, never the
other way), ``queues/`` (the worker side of each Celery queue: bulk chunks, interactive batches and
queries, the vector store's writes, searches and points), and per request: ``upload``, ``search``,
``reconcile``, with ``waiting`` beneath them.
"""
