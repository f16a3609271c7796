"""Signed webhooks (issue 42, docs/webhooks.md): the endpoints an account or a job names
(:mod:`.endpoints`: checked, given a secret, rotated), the messages made when a job or a model
migration changes state (:mod:`.events`: what the catalogue and the lifecycle call), and their
sending (:mod:`.delivery`: queued on the fetch queue, signed, retried on a schedule kept in the
database). Nothing here imports the catalogue or the lifecycle: they call in.
"""
