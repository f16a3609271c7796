"""Exports of stored vectors (docs/exports.md): which rows, read a page at a time with their
vectors (:mod:`.rows`), and the files they are written into, Parquet, JSON Lines or a NumPy
``.npz``, streamed in bounded memory (:mod:`.formats`).
"""
