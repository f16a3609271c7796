"""The model lifecycle: model migrations (re-embed the catalogue in another space, promote, roll
back, drop), the quality gate that guards a promotion, and each space's calibrated score cutoff."""
