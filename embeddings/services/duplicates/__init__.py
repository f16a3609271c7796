"""Near-duplicate groups (issue 45): per owner and embedding space, groups of images whose vectors
are within a threshold calibrated from copies of the owner's own images, with exact copies (the
same bytes) as their own kind; found by the store's batched neighbour queries as background work
(:mod:`.scan`), kept as rows (:mod:`.groups`), reviewed by people (:mod:`.review`): keep one and
delete the rest, or "not duplicates", remembered. docs/duplicates.md.
"""
