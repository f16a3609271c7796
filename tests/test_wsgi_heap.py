"""The web process freezes its start-up heap with the URL configuration loaded (``project.wsgi``),
so no request's answer pays for a full collection over Django's, DRF's and the views' objects."""
from __future__ import annotations

import gc


def test_the_web_process_starts_with_its_urls_loaded_and_its_heap_frozen(monkeypatch):
    import project.wsgi

    calls: list[str] = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    project.wsgi.freeze_start_up_heap()
    assert calls == ["collect", "freeze"]  # garbage first: nothing dead is kept for good
    from django.urls import get_resolver

    assert "url_patterns" in get_resolver().__dict__  # loaded: the first request imports nothing
    monkeypatch.undo()
    assert gc.get_freeze_count() > 10_000  # the import itself froze what was alive then
