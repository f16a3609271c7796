"""The Keys page (``/keys/``): the signed-in user's API keys, a form that makes one (its secret
shown on the answering page, this once) and a button that revokes one. The same services as
``/api/keys/`` (``services.access.keys``), with the same refusals."""
from __future__ import annotations

import datetime as dt

from django import forms
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods, require_POST

from embeddings.errors import ApplicationError
from embeddings.models import ADMIN_SCOPE, PRESETS, SCOPES, ApiKey
from embeddings.services.access import keys as key_services
from embeddings.site.words import reason_words


class KeyForm(forms.Form):
    """A new key: a name, a preset or scopes, an optional lifetime in days."""

    name = forms.CharField(max_length=100, help_text="What the key is for, e.g. “search script”.")
    preset = forms.ChoiceField(required=False, choices=[("", "none: the scopes ticked below")]
                               + [(p, p) for p in PRESETS], initial="read-only")
    scopes = forms.MultipleChoiceField(required=False, widget=forms.CheckboxSelectMultiple,
                                       choices=[(s, f"{s}: {words}") for s, words in SCOPES.items()])
    days = forms.IntegerField(required=False, min_value=1, max_value=3650, label="Expires after (days)",
                              help_text="Empty: never.")

    def __init__(self, *args, staff: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if not staff:
            self.fields["scopes"].choices = [c for c in self.fields["scopes"].choices if c[0] != ADMIN_SCOPE]


@never_cache  # the answer to a POST holds a secret: no cache keeps a copy
@login_required
@require_http_methods(["GET", "POST"])
def keys(request):
    """``GET /keys/``: the user's keys and the form; ``POST`` (CSRF): make a key, shown with its secret once."""
    form = KeyForm(request.POST or None, staff=request.user.is_staff)
    made, error = None, None
    if request.method == "POST" and form.is_valid():
        v = form.cleaned_data
        names = [*([v["preset"]] if v["preset"] else []), *v["scopes"]]
        expires = timezone.now() + dt.timedelta(days=v["days"]) if v.get("days") else None
        try:
            made = key_services.key_create(owner=request.user, name=v["name"], scopes=names, expires_at=expires)
        except ApplicationError as e:
            error = {"code": e.code, "message": e.message, "words": reason_words(e.code)}
        else:
            form = KeyForm(staff=request.user.is_staff)
    rows = ApiKey.objects.filter(owner=request.user).order_by("-created_at")[:200]
    return render(request, "site/keys.html", {"form": form, "made": made, "error": error, "rows": rows},
                  status=400 if request.method == "POST" and made is None else 200)


@login_required
@require_POST
def key_revoke(request, key_id):
    """``POST /keys/{id}/revoke/`` (CSRF): revoke one of the user's keys, back to the Keys page."""
    key_services.key_revoke(key=get_object_or_404(ApiKey, pk=key_id, owner=request.user))
    return redirect("site-keys")
