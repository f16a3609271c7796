"""OpenAI's Batch API on the bulk lane (issue 56, docs/batch-api.md): files (``files``), batches made,
listed and cancelled (``batches``), a part's lines run on the bulk worker (``parts``), the output
and error files written (``output``)."""
