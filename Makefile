# The README's two commands: `make demo` (set up, run the main job on real photos) and `make test`
# (set up, pass the tests). Both work from a fresh clone; each step below is idempotent.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The manifests' checkers in their own virtual environment: checkov pins its own versions of packages
# the service also uses (requirements-deploy.txt; make deploy-check).
DEPLOY_VENV := .venv-deploy
DEPLOY_STAMP := $(DEPLOY_VENV)/.installed
# This machine cannot download weights: the demo selects seeded random weights explicitly unless
# told otherwise, e.g. `make demo CLIP_PRETRAINED=laion2b_s34b_b79k` or a checkpoint file path.
CLIP_PRETRAINED ?= random
FOLDER ?= samples

.PHONY: setup browser demo test deploy-tools deploy-config deploy-check test-fast test-e2e run bench bench-lanes procfile clean bench-matrix bench-bulk soak bench-load bench-sched schema bench-db bench-migration config-docs bench-ingest bench-batch bench-export bench-previews bench-decode bench-model bench-path bench-writer bench-batch-memory bench-duplicates bench-fairness bench-keys

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $(STAMP)

# A private secret key for this checkout (production reads DJANGO_SECRET_KEY from its environment).
.env:
	$(PYTHON) -c "import secrets; print('DJANGO_SECRET_KEY=' + secrets.token_urlsafe(50))" > .env

setup: $(STAMP) .env

demo: setup
	CLIP_PRETRAINED=$(CLIP_PRETRAINED) $(PY) -m scripts.demo $(FOLDER)

# The browser tests (tests/e2e/test_site_browser.py) drive Debian's chromium with Playwright
# (Playwright's own browser download cannot run here). Installed when missing and we are root with
# apt-get; otherwise those tests are skipped with that reason.
browser:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  (apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium; }) \
	  || echo "chromium could not be installed: the browser tests will be skipped"; \
	else echo "chromium is not installed (apt-get install chromium as root): the browser tests will be skipped"; fi

# The whole suite in two parts (tests/conftest.py, --part): first the tests that start no stack of
# their own beside the others, spread over TEST_PROCESSES processes (pytest-xdist, a test file per
# process at a time; each process has its own test database, Redis and folders), then the end-to-end
# tests (marker e2e) one after another on quiet cores, since their stacks and their timing checks must
# not share the cores with other tests. Both parts run whatever the first gives; a part that
# PYTEST_ARGS leaves empty exits 5 (pytest: no test selected), which fails only when both do.
TEST_PROCESSES ?= logical
test: setup browser deploy-tools
	$(PY) -m pytest --part parallel -n $(TEST_PROCESSES) --dist loadfile $(PYTEST_ARGS); a=$$?; \
	$(PY) -m pytest --part serial $(PYTEST_ARGS); b=$$?; \
	for rc in $$a $$b; do [ $$rc = 0 ] || [ $$rc = 5 ] || exit $$rc; done; \
	[ $$a$$b != 55 ] || exit 5

# The working loop: the suite without the end-to-end tests (tests/e2e, marker e2e) and the tests that
# load the real model (marker model, set in tests/conftest.py); `make test` stays the whole suite (CI).
test-fast: setup
	$(PY) -m pytest -m "not e2e and not model" -n $(TEST_PROCESSES) --dist loadfile $(PYTEST_ARGS)

test-e2e: setup browser
	$(PY) -m pytest tests/e2e $(PYTEST_ARGS)

# Like `make demo`, seeded random weights unless told otherwise, e.g.
# `make run CLIP_PRETRAINED=laion2b_s34b_b79k` (needs the download or a cached copy).
run: setup
	CLIP_PRETRAINED=$(CLIP_PRETRAINED) $(PY) -m scripts.stack

# Interactive latency and bulk throughput, alone and together (docs/lanes.md); e.g.
# make bench-lanes BENCH_ARGS="--bulk-images 128 --requests 20" for a quick check;
# BENCH_ARGS="--hops --requests 30": an idle request's time, hop by hop (issue 58);
# BENCH_ARGS="--hops --compare-owners": the same with each STORE_OWNER, side by side.
bench-lanes: setup
	$(PY) -m benchmarks.lanes $(BENCH_ARGS)

# Issue 5 (docs/benchmarks-bulk.md): the experiment matrix, and bulk throughput against the bound,
# the naive baseline and cost; BENCH_ARGS="--quick" for a short check, e.g.
# make bench-bulk BENCH_ARGS="--price-per-hour 0.50 --cosine".
bench-matrix: setup
	$(PY) -m benchmarks.matrix $(BENCH_ARGS)

bench-bulk: setup
	$(PY) -m benchmarks.bulk $(BENCH_ARGS)

# Issue 6 (docs/operations.md): 5,000 images through both lanes with faults injected at random
# times, then DB counts = Qdrant points = distinct inputs; e.g. SOAK_ARGS="--images 1000 --faults 3".
soak: setup
	$(PY) -m scripts.soak $(SOAK_ARGS)

# The interactive endpoint at 2x its measured capacity for 60 s (issue 15): admitted requests answer
# within their deadline, Retry-After is honest, goodput holds; no 5xx, worker RSS flat; plots predicted
# vs actual wait (docs/benchmarks-load.md); e.g. BENCH_ARGS="--deadline 1 2 5 --with-bulk 0 3000", "--rate 4".
bench-load: setup
	$(PY) -m benchmarks.load $(BENCH_ARGS)

# How much a bulk forward pass slows an interactive one on the same cores, by the bulk worker's
# scheduling policy (alone / nice 19 / SCHED_IDLE; docs/benchmarks-load.md), ~2 min.
bench-sched: setup
	$(PY) -m benchmarks.sched_policy $(BENCH_ARGS)

# Issue 13 (docs/benchmarks-migration.md): interactive p95 alone and while a migration re-embeds a
# 500-image catalogue with another model; its images/s, the quality gate, promote→visible. A few
# minutes; make bench-migration BENCH_ARGS="--images 100 --seconds 20" for a quick check.
bench-migration: setup
	$(PY) -m benchmarks.migration $(BENCH_ARGS)

# Issue 10 (docs/benchmarks.md): the embedded stores side by side (qdrant-edge and local mode, same
# data: upsert points/s, top-10 and filtered top-10 p50/p95, recall@10, memory); and the whole write
# path without a model (Redis → vectors worker → store → database marks), e.g.
# make bench-store BENCH_ARGS="--sizes 2000 --queries 20" or make bench-sink BENCH_ARGS="--points 2000".
bench-store: setup
	$(PY) -m benchmarks.store $(BENCH_ARGS)

bench-sink: setup
	$(PY) -m benchmarks.sink $(BENCH_ARGS)

# Issue 11 (docs/scaling.md): database time per chunk against the job's size (1,000 to 100,000
# synthetic rows), on SQLite and on PostgreSQL (a scratch database on 127.0.0.1:5432, created and
# dropped), e.g. make bench-db BENCH_ARGS="--sizes 1000 10000 --backends sqlite".
bench-db: setup
	$(PY) -m benchmarks.db $(BENCH_ARGS)

# Issue 41 (docs/benchmarks-ingest.md): a 100,000-row URL manifest and a 100,000-object moto prefix
# into the running service (answer after the upload, web memory, first image embedded, rows made and
# fetched per second), the fetcher alone, and benchmarks.store's filtered search; ~20 min (seeding
# moto takes a third); make bench-ingest BENCH_ARGS="--quick" for 5,000 of each (~5 min).
bench-ingest: setup
	$(PY) -m benchmarks.ingest $(BENCH_ARGS)

# Issue 56 (docs/batch-api.md): a batch of image URLs against a manifest job of the same inputs
bench-batch: setup
	$(PY) -m benchmarks.batch_api $(BENCH_ARGS)

# Issue 42 (docs/benchmarks-export.md): 10,000 and 100,000 stored vectors exported through the real
# view in each format (Parquet, JSON Lines, .npz): MB/s and the process's peak RSS, ~5 min;
# make bench-export BENCH_ARGS="--rows 2000" for a quick check.
bench-export: setup
	$(PY) -m benchmarks.export $(BENCH_ARGS)

# Issue 43 item 1 (docs/previews.md): preview formats (decode ms, bytes, cosine), what a preview adds
# to a first embedding and saves a re-embed, and the cosine from previews on every photo and odd file, ~5 min.
bench-previews: setup
	$(PY) -m benchmarks.previews $(BENCH_ARGS)

# Issue 43 item 2 (docs/decoding.md, "Routing by what the bytes are"): simplejpeg vs OpenCV on the
# JPEG photos, and the CPU decode processes vs threads; e.g. BENCH_ARGS="--rounds 2".
bench-decode: setup
	$(PY) -m benchmarks.decode_routes $(BENCH_ARGS)

# Issue 43 item 4 (docs/benchmarks-model.md): the image tower model-only on torch eager, torch.compile,
# OpenVINO and ONNX Runtime, 2 threads each (images/s at batch 1/16/64, export time, cosine to open_clip),
# ~5 min; make bench-model BENCH_ARGS="--quick" for batch 64 of the main rows (~1 min).
bench-model: setup
	$(PY) -m benchmarks.model_backends $(BENCH_ARGS)

# Issue 45 item 3 (docs/duplicates-benchmarks.md): near-duplicate groups of the photos and their copies
# at the calibrated threshold and around it, the full scan of 100,000 points with an incremental step,
# and grouping a long chain, ~10 min on 2 cores; BENCH_ARGS="--points 20000 --clusters 400" (~3 min).
bench-duplicates: setup
	$(PY) -m benchmarks.duplicates $(BENCH_ARGS)

# The versioned OpenAPI schema (tests/embeddings/api/test_schema.py fails when the served one differs):
# run after any API change and commit docs/openapi.yaml with it.
# The reference deployment (tests/embeddings/api/test_schema.py REFERENCE): fp32 on the CPU, whatever this CPU is.
schema: setup
	CLIP_PRECISION=fp32 CLIP_DEVICE=cpu $(PY) manage.py spectacular --file docs/openapi.yaml --validate --fail-on-warn

# The README's configuration tables, generated from project/configuration.py
# (tests/test_configuration.py fails when they differ): run after declaring or changing a variable.
config-docs: setup
	$(PY) -m project.configuration --write README.md

# The Procfile for `honcho start` (the venv's honcho, from requirements-dev.txt). Written to a
# temporary file first, so a failure never leaves an empty or partial Procfile behind.
procfile: setup
	$(PY) -m project.processes > Procfile.tmp || { rm -f Procfile.tmp; exit 1; }
	mv -f Procfile.tmp Procfile

clean:
	rm -rf var .pytest_cache

# The bulk path without the model (issue 43 item 3, docs/scaling.md): a real stack whose workers run a
# fixed-vector encoder; first embeddings against the decode bound, a re-embed from previews. ~6 min;
# make bench-path BENCH_ARGS="--images 3000 --originals 168" for a short check.
bench-path: setup
	$(PY) -m benchmarks.bulk_path --postgres $(BENCH_ARGS)

# A bulk chunk's model input with glibc's default malloc thresholds against BULK_BATCH_MEMORY_MB's
# (issue 58 item 3, docs/scaling.md): stack + normalise per chunk, page faults, settings alternating.
bench-batch-memory: setup
	$(PY) -m benchmarks.batch_memory $(BENCH_ARGS)

# The vectors writer alone, stage by stage (issue 58 item 2, docs/scaling.md): index_chunk of 512
# points in-process on scratch PostgreSQL; BENCH_ARGS="--before /path/to/old/checkout" alternates
# the code before a change with this one in the same session.
bench-writer: setup
	$(PY) -m benchmarks.writer $(BENCH_ARGS)

# Kubernetes (deploy/kubernetes, docs/deploy.md): the checkers' own environment; the ConfigMap and
# Secret files generated from project/configuration.py; every overlay rendered (kubectl kustomize),
# validated offline against the Kubernetes schemas, linted (checkov) and checked against the declared
# settings and processes (scripts/deploy_check.py; tests/test_deploy.py runs it in `make test`).
$(DEPLOY_STAMP): requirements-deploy.txt
	@command -v kubectl >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && (apt-get install -y -qq kubectl >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq kubectl; }); } \
	  || echo "kubectl is not installed (apt-get install kubectl as root): the manifests' tests will be skipped"
	test -x $(DEPLOY_VENV)/bin/python || $(PYTHON) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/python -m pip install --quiet -r requirements-deploy.txt
	touch $(DEPLOY_STAMP)

deploy-tools: $(DEPLOY_STAMP)

deploy-config: setup
	$(PY) -m scripts.deploy_config --write

deploy-check: setup deploy-tools
	$(PY) -m scripts.deploy_check --tools $(DEPLOY_VENV)/bin

# Issue 54 (docs/lanes.md, "The bulk lane's order"): the bulk lane under BULK_SCHEDULER=fifo and fair,
# a real stack each: a small job behind a big one, three owners (equal weights, 2:1:1), deadlines,
# throughput; a table, PASS/FAIL lines and a plot under var/bench-fairness. ~8 min on 2 cores.
bench-fairness: setup
	$(PY) -m benchmarks.fairness $(BENCH_ARGS)

# Issue 55 (docs/api-keys.md, "Cost per request"): what API keys, their limits and usage metering add
# to a one-image interactive upload, side by side with a DRF token (the feature off) on one stack, and
# each component timed directly; PASS/FAIL against p95 added <= 2 ms, JSON and plot under docs/bench.
# ~5 min on 2 cores; make bench-keys BENCH_ARGS="--pairs 20 --iterations 200" for a quick check.
bench-keys: setup
	$(PY) -m benchmarks.keys_cost $(BENCH_ARGS)
