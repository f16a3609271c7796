"""The embedding pipeline as a plain library: decode → preprocess → encode → sink.

No Django or Celery import anywhere in this package, so each stage can be tested and benchmarked
alone. Modules, one role each:

- ``config``: the one typed configuration object (:class:`~workers.config.PipelineConfig`).
- ``errors``: :class:`~workers.errors.ImageRejected` and the stable reason codes.
- ``decode``: encoded bytes → upright RGB ``(H, W, 3) uint8`` (OpenCV, Pillow where needed).
- ``preprocess``: RGB ``uint8`` → the model's input ``(3, S, S) float32``, per open_clip's config.
- ``model``: open_clip loading and ``encode_images`` / ``encode_texts``.
- ``batcher``: the in-process dynamic batcher (bounded queue delay) for the interactive lane.
- ``runner``: composes the stages for one batch and times each one.
- ``screen``: refuses vectors that are not finite or are all zeros (reason codes), before any store.
- ``vector_store``: the Qdrant sink and search.
- ``ids`` / ``model_config`` / ``timing``: point ids, torch-free model facts, stage timers.
"""
