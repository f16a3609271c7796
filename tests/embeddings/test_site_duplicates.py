"""The duplicates page (``embeddings/site/duplicates.py``) and the duplicates admin, in one process
(eager Celery, embedded Qdrant, random-weights model): the scan box before and after a scan, the
open groups near and exact apart, largest first, paginated; "keep selected" and "not duplicates"
through the review services; refusals as messages, never a 500; other users' groups out of reach."""
from __future__ import annotations

import re

import pytest
from django.test import Client

from embeddings import spaces
from embeddings.models import DuplicateGroup, DuplicateMember, DuplicateScan, Image, NotDuplicate, ScanState
from tests.embeddings.conftest import client_for, jpeg_bytes, upload

pytestmark = pytest.mark.django_db(transaction=True)


def signed_in(u, **kw) -> Client:
    c = Client(**kw)
    c.force_login(u)
    return c


def uploaded(api, names: list[str], seed: int, *, seeds: list[int] | None = None) -> list[Image]:
    """One image per name, the picture ``jpeg_bytes(seed + i)`` (or ``seeds[i]``: a seed repeated is
    the same bytes again, stored as another row of them), as rows."""
    seeds = seeds or [seed + i for i in range(len(names))]
    r = api.post("/api/images/", {"files": [upload(n, jpeg_bytes(s)) for n, s in zip(names, seeds)], "k": 0},
                 format="multipart")
    assert r.status_code == 200, r.json()
    ids = [im["id"] for im in r.json()["images"]]
    assert {im["status"] for im in r.json()["images"]} <= {"embedded", "skipped"}
    return [Image.objects.get(id=i) for i in ids]


def group(images: list[Image], scores: list[float], *, kind: str = "near", threshold: float = 0.93) -> DuplicateGroup:
    """A group row of ``images`` in the active space, the first the representative."""
    g = DuplicateGroup.objects.create(owner=images[0].owner, model_id=spaces.active().model_id, kind=kind,
                                      threshold=threshold)
    for i, (im, score) in enumerate(zip(images, scores)):
        DuplicateMember.objects.create(group=g, image=im, point_id=im.point_id, score=score, representative=i == 0)
    return g


def group_ids(html: str) -> list[str]:
    """The groups on the page, in its order."""
    return re.findall(r'<article class="dup-group" id="group-([0-9a-f-]+)"', html)


def messages_of(html: str) -> list[str]:
    """The page's messages (after a form's redirect), as text."""
    box = re.search(r'<div class="messages">(.*?)</div>', html, re.S)
    return [re.sub(r"\s+", " ", m).strip() for m in re.findall(r"<p [^>]*>(.*?)</p>", box.group(1) if box else "", re.S)]


def page(c: Client, **query) -> str:
    r = c.get("/duplicates/", query)
    assert r.status_code == 200
    return r.content.decode()


@pytest.fixture
def catalogue(service, api, user, other_user):
    """Alice's six images in a done scan: near groups of 3 and 2, an exact group of 2 (the sixth
    image is the first's bytes again), and one group of Bob's."""
    mine = uploaded(api, [f"a{i}.jpg" for i in range(5)], seed=100)
    mine += uploaded(api, ["a5.jpg"], seed=100)  # a0's bytes: its exact copy
    theirs = uploaded(client_for(other_user), ["b0.jpg", "b1.jpg"], seed=200)
    DuplicateScan.objects.create(owner=user, model_id=spaces.active().model_id, state=ScanState.DONE, threshold=0.93,
                                 calibration={"source": "calibrated", "threshold": 0.93, "recall_copies": 0.9792,
                                              "neighbours_above": 0.0, "sample": 48, "copies": 192},
                                 scanned=6, groups=2)
    return {"mine": mine, "theirs": theirs,
            "pair": group(mine[3:5], [1.0, 0.9531]),
            "three": group(mine[0:3], [1.0, 0.9987, 0.9412]),
            "exact": group([mine[0], mine[5]], [1.0, 1.0], kind="exact", threshold=1.0),
            "bobs": group(theirs, [1.0, 0.97])}


def test_the_page_before_any_scan(service, user):
    html = page(signed_in(user))
    assert '<a href="/duplicates/" aria-current="page">Duplicates</a>' in html
    assert "You have not scanned for duplicates yet." in html
    assert '<button type="submit">Scan for duplicates</button>' in html
    assert group_ids(html) == [] and "No groups yet: scan for duplicates first." in html
    assert 'class="scan-facts' not in html and "duplicates.js" not in html  # nothing running: no refresh


def test_pages_need_a_signed_in_user(service):
    r = Client().get("/duplicates/")
    assert r.status_code == 302 and r["Location"].startswith("/login/")


def test_open_groups_near_and_exact_apart_largest_first(catalogue, user):
    c = signed_in(user)
    html = page(c)
    assert group_ids(html) == [str(catalogue["three"].id), str(catalogue["pair"].id)]  # 3 images, then 2
    assert str(catalogue["bobs"].id) not in html and "b0.jpg" not in html
    # the scan: threshold, how it was set, the calibration in percentages, points and groups
    assert '<span class="score" id="scan-threshold">0.9300</span>' in html
    assert '<span class="hint" id="scan-source">calibrated</span>' in html
    calibration = re.sub(r"\s+", " ", re.search(r'id="scan-calibration">(.*?)</dd>', html, re.S).group(1)).strip()
    assert calibration == "copies found: 97.9 % · sampled images with a neighbour at or above it: 0.0 %"
    assert "Calibration on 48 of your images and 192 copies of them" in html
    assert '<dd id="scan-scanned">6</dd>' in html and '<dd id="scan-groups">2</dd>' in html
    # each member: thumbnail, cosine to the representative (4 decimals), the representative checked
    three = html[html.index(f'id="group-{catalogue["three"].id}"'):html.index(f'id="group-{catalogue["pair"].id}"')]
    assert re.findall(r'<span class="score" title="cosine to the representative: [0-9.]+">([0-9.]+)</span>', three) == [
        "1.0000", "0.9987", "0.9412"]
    assert re.findall(r'src="/api/images/([0-9a-f-]+)/thumbnail/"', three) == [str(im.id) for im in catalogue["mine"][:3]]
    checked = re.findall(r'name="image_id" value="([0-9a-f-]+)"( checked)?', three)
    assert checked == [(str(catalogue["mine"][0].id), " checked"), (str(catalogue["mine"][1].id), ""),
                       (str(catalogue["mine"][2].id), "")]
    assert three.count("★ representative") == 1 and "Not duplicates" in three
    assert "near copies at ≥ 0.9300" in three
    assert re.findall(r'Near<span class="wide-only"> copies</span> <span class="count">(\d+)</span>', html) == ["2"]
    assert re.findall(r'Exact<span class="wide-only"> copies</span> <span class="count">(\d+)</span>', html) == ["1"]

    exact = page(c, kind="exact")
    assert group_ids(exact) == [str(catalogue["exact"].id)]
    assert "Not duplicates" not in exact and "exact copies" in exact


def test_keep_selected_deletes_the_rest_and_resolves_the_group(catalogue, user, api):
    c = signed_in(user)
    three, keep = catalogue["three"], catalogue["mine"][1]
    r = c.post(f"/duplicates/{three.id}/keep/", {"image_id": str(keep.id), "kind": "near", "status": "open"})
    assert r.status_code == 302 and r["Location"] == "/duplicates/?kind=near&status=open"
    assert Image.objects.filter(owner=user).count() == 4  # six less the other two of the group
    assert set(Image.objects.filter(owner=user).values_list("id", flat=True)) == {
        im.id for im in catalogue["mine"] if im not in catalogue["mine"][0:3:2]}
    assert Image.objects.filter(owner=catalogue["theirs"][0].owner).count() == 2
    three.refresh_from_db()
    assert three.status == "resolved" and three.kept_id == keep.id and three.reviewed_at is not None
    # their points went with them: a search finds the four left
    hits = api.post("/api/search/", {"text": "a photo", "k": 10}, format="json").json()["results"]
    assert len(hits) == 4
    html = c.get(r["Location"]).content.decode()
    assert messages_of(html) == ["Kept a1.jpg; deleted 2 other images."]
    assert group_ids(html) == [str(catalogue["pair"].id)]
    # the exact group lost its representative (deleted): one image left is no group
    assert group_ids(page(c, kind="exact")) == []
    reviewed = page(c, status="reviewed")
    assert group_ids(reviewed) == [str(three.id)] and '<span class="badge s-done">kept</span>' in reviewed

    again = c.post(f"/duplicates/{three.id}/keep/", {"image_id": str(keep.id)}, follow=True)
    assert again.status_code == 200
    assert messages_of(again.content.decode()) == ["this group was already reviewed (resolved) (already_reviewed)"]
    assert Image.objects.filter(owner=user).count() == 4


def test_keep_an_image_outside_the_group_is_refused(catalogue, user):
    c = signed_in(user)
    for chosen in (str(catalogue["mine"][5].id), "", "not-an-id"):
        r = c.post(f"/duplicates/{catalogue['pair'].id}/keep/", {"image_id": chosen, "page": "1"}, follow=True)
        assert r.status_code == 200 and r.redirect_chain == [("/duplicates/?kind=near&status=open", 302)]
        assert messages_of(r.content.decode()) == [
            "the image to keep is not a member of this group (not_a_member)"], chosen
    assert Image.objects.filter(owner=user).count() == 6
    assert DuplicateGroup.objects.get(id=catalogue["pair"].id).status == "open"


def test_not_duplicates_dismisses_the_group_and_remembers_its_pairs(catalogue, user):
    c = signed_in(user)
    r = c.post(f"/duplicates/{catalogue['three'].id}/not-duplicates/", {"kind": "near", "status": "open"}, follow=True)
    assert r.status_code == 200
    assert messages_of(r.content.decode()) == ["Marked 3 images as not duplicates: they will not be grouped again."]
    assert DuplicateGroup.objects.get(id=catalogue["three"].id).status == "dismissed"
    shas = sorted(im.sha256 for im in catalogue["mine"][:3])
    assert sorted(NotDuplicate.objects.filter(owner=user).values_list("sha_a", "sha_b")) == [
        (shas[0], shas[1]), (shas[0], shas[2]), (shas[1], shas[2])]  # 3 pairs of 3 images
    assert Image.objects.filter(owner=user).count() == 6  # nothing deleted
    assert group_ids(r.content.decode()) == [str(catalogue["pair"].id)]

    exact = c.post(f"/duplicates/{catalogue['exact'].id}/not-duplicates/", {"kind": "exact"}, follow=True)
    assert messages_of(exact.content.decode()) == ["these images are the same bytes: keep one instead (exact_copies)"]
    assert exact.redirect_chain == [("/duplicates/?kind=exact&status=open", 302)]
    assert DuplicateGroup.objects.get(id=catalogue["exact"].id).status == "open"
    assert NotDuplicate.objects.count() == 3


def test_another_users_group_is_out_of_reach(catalogue, user, other_user, staff):
    c = signed_in(user)
    bobs = catalogue["bobs"]
    for action, data in (("keep", {"image_id": str(catalogue["theirs"][1].id)}), ("not-duplicates", {})):
        r = c.post(f"/duplicates/{bobs.id}/{action}/", data, follow=True)
        assert r.status_code == 200 and messages_of(r.content.decode()) == ["no such duplicate group (not_found)"]
    assert Image.objects.filter(owner=other_user).count() == 2 and NotDuplicate.objects.count() == 0
    assert DuplicateGroup.objects.get(id=bobs.id).status == "open"
    assert c.post("/duplicates/00000000-0000-0000-0000-000000000000/keep/", follow=True).status_code == 200
    assert c.post("/duplicates/nonsense/keep/").status_code == 404
    assert c.get(f"/duplicates/{bobs.id}/keep/").status_code == 405  # POST only
    # staff see everyone's groups, with their owner
    everyone = page(signed_in(staff))
    assert set(group_ids(everyone)) == {str(catalogue[k].id) for k in ("three", "pair", "bobs")}
    assert "· bob" in everyone


def test_forms_need_the_csrf_token(catalogue, user):
    c = signed_in(user, enforce_csrf_checks=True)
    r = c.post(f"/duplicates/{catalogue['pair'].id}/keep/", {"image_id": str(catalogue["mine"][3].id)})
    assert r.status_code == 403 and Image.objects.filter(owner=user).count() == 6
    assert c.post("/duplicates/scan/").status_code == 403


def test_twenty_groups_a_page(service, api, user):
    a, b = uploaded(api, ["p.jpg", "q.jpg"], seed=300)
    made = [group([a, b], [1.0, 0.95]) for _ in range(21)]
    c = signed_in(user)
    first, second = page(c), page(c, page=2)
    assert len(group_ids(first)) == 20 and len(group_ids(second)) == 1
    assert set(group_ids(first)) | set(group_ids(second)) == {str(g.id) for g in made}
    assert "Page 1 of 2" in first and 'rel="next" href="?kind=near&amp;status=open&amp;page=2"' in first
    assert len(group_ids(page(c, page="junk"))) == 20  # a page that is not a number: the first
    # a form posted from page 2 comes back to page 2
    r = c.post(f"/duplicates/{made[0].id}/not-duplicates/", {"kind": "near", "status": "open", "page": "2"})
    assert r["Location"] == "/duplicates/?kind=near&status=open&page=2"


def test_scan_button_with_a_given_threshold(service, api, user):
    uploaded(api, [f"s{i}.jpg" for i in range(4)], seed=400)
    c = signed_in(user)
    r = c.post("/duplicates/scan/", {"threshold": "0.999", "kind": "exact", "status": "open"}, follow=True)
    assert r.redirect_chain == [("/duplicates/?kind=exact&status=open", 302)]
    scan = DuplicateScan.objects.get(owner=user)
    assert (scan.state, scan.threshold, scan.calibration, scan.scanned) == ("done", 0.999, {"source": "given"}, 4)
    html = r.content.decode()
    assert messages_of(html) == [f"Scan finished: {scan.groups} group(s) of near copies."]
    assert '<span class="hint" id="scan-source">given</span>' in html and "scan-calibration" not in html
    assert '<button type="submit">Scan again</button>' in html

    for bad in ("2", "0", "abc"):
        refused = c.post("/duplicates/scan/", {"threshold": bad}, follow=True)
        assert refused.status_code == 200
        assert messages_of(refused.content.decode())[0].endswith("(invalid)"), bad
    assert DuplicateScan.objects.get(owner=user).threshold == 0.999  # the refused ones started nothing


def test_scan_button_calibrates_and_falls_back_to_the_default_with_few_images(service, api, user, settings):
    uploaded(api, [f"c{i}.jpg" for i in range(3)], seed=500)
    r = signed_in(user).post("/duplicates/scan/", {"threshold": ""}, follow=True)
    scan = DuplicateScan.objects.get(owner=user)
    assert scan.state == "done" and scan.calibration["source"] == "default" and scan.calibration["sample"] == 3
    assert scan.threshold == settings.DUPLICATES_DEFAULT_THRESHOLD
    html = r.content.decode()
    assert '<span class="hint" id="scan-source">default</span>' in html
    assert "too few images to calibrate: the default threshold" in html and "Calibration on 3 of your images" in html


def test_a_running_scan_is_shown_and_refreshed(service, user):
    DuplicateScan.objects.create(owner=user, model_id=spaces.active().model_id, state=ScanState.SCANNING,
                                 threshold=0.95, calibration={"source": "given"}, scanned=512)
    html = page(signed_in(user))
    assert 'data-running="1"' in html and "/static/site/duplicates.js" in html
    assert "Scanning: 512 points so far…" in html and "No groups yet: the scan is still running." in html


def test_admin_lists_scans_groups_and_not_duplicates(catalogue, user, staff):
    signed_in(user).post(f"/duplicates/{catalogue['three'].id}/not-duplicates/")
    admin = signed_in(staff)
    for url in ("/admin/embeddings/duplicatescan/", "/admin/embeddings/duplicategroup/",
                "/admin/embeddings/duplicategroup/?kind__exact=near&status__exact=open",
                "/admin/embeddings/notduplicate/",
                f"/admin/embeddings/duplicategroup/{catalogue['three'].id}/change/",
                f"/admin/embeddings/duplicatescan/{DuplicateScan.objects.get(owner=user).pk}/change/"):
        r = admin.get(url)
        assert r.status_code == 200, url
    groups = admin.get("/admin/embeddings/duplicategroup/?o=5").content.decode()  # by size
    assert groups.count('class="field-size"') == 4
    scan = admin.get(f"/admin/embeddings/duplicatescan/{DuplicateScan.objects.get(owner=user).pk}/change/")
    assert "&quot;recall_copies&quot;: 0.9792" in scan.content.decode()
    change = admin.get(f"/admin/embeddings/duplicategroup/{catalogue['three'].id}/change/").content.decode()
    assert change.count("/thumbnail/") == 3
    assert admin.get("/admin/embeddings/notduplicate/").content.decode().count('class="field-sha_b"') == 3
