"""Usage metering (docs/usage.md): who used what, per key, owner, model, kind and day.

- ``keys``: the API key's public prefix of a request (the one thing metering knows of keys);
- ``meter``: counter rows incremented in the transaction that commits the work they count;
- ``report``: the rows read back, grouped and priced (``GET /api/usage/``, the site's page).
"""
