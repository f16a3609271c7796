"""Who may call, and how much (issue 55, docs/api-keys.md): API keys (:mod:`.keys`: made with a
secret shown once and stored as a hash, checked, revoked, migrated from DRF's plaintext tokens),
their scopes (:mod:`.scopes`: presets, what a credential holds), and the per-key limits enforced in
Redis across web processes (:mod:`.limits`). Nothing here imports another wing.
"""
