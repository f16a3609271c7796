"""The worker side of the queues: what the Celery tasks of each queue call (``embeddings.tasks``),
one module per queue: ``bulk`` (a bulk chunk's embedding), ``interactive`` (an upload's images,
query images and texts, the inputs of an embeddings request), ``vectors`` (the vector store's owner:
point writes, searches, deletions, counts). Beneath them, what two queues share: ``store_writes``
(writing points, and how a store that cannot be written shows on the images) and ``blobs`` (the
originals a worker reads, and the thumbnails and previews drawn from what it decodes). Each entry
point returns JSON primitives, ready to be a task result; a bad image or input is an answer, not an
error.
"""
