#!/usr/bin/env bash
# The GPU check of issues 5 and 43 in one short run (< 9 minutes: the steps share a 510 s
# budget; run it with timeout_s=570), everything under $OUT.
#
#   bash benchmarks/gpu_check.sh --prepare   # HERE, once: the wheels the device lacks (.whl/) and the
#                                            # photos + manifest (out/gpu_data/); both git-ignored
#   bash benchmarks/gpu_check.sh             # THERE (device run, carry [".whl", "out/gpu_data"])
#
# What travels: the working tree, .whl/ and out/gpu_data/, 64 MiB together (the device tool's
# limit), so --prepare keeps the carried part small and prints the total: nvImageCodec's wheel
# repacked with only what the device JPEG route loads (Python 3.12's module, its nvJPEG extension),
# nvJPEG's own library (the device image lists no nvidia-nvjpeg), and each photo once: those that
# samples/ already holds byte for byte are taken from there (checked by SHA-256 on arrival).
#
# On the GPU machine it:
#   1. installs the missing wheels (open_clip_torch, ftfy, wcwidth, simplejpeg, nvidia-nvimgcodec-cu13,
#      nvidia-nvjpeg) from .whl/ into /tmp/site (that machine reaches no registry; torch,
#      torchvision, OpenCV, Pillow, psutil, nvidia-ml-py, matplotlib are already there), and lays
#      out the 84 photos where the tests and benchmarks look (the odd files stay here: no CUDA test
#      reads them, and the tests that do are deselected there);
#   2. tests/workers/test_precision.py: every precision (fp32/bf16/fp16) × preprocessing
#      (cpu/gpu/gpu_decode) on CUDA within cosine 0.99 of fp32 on each of the 84 photos;
#   3. tests/workers/test_decode_route.py: routes, fallbacks, and on CUDA the nvImageCodec and
#      torchvision device routes against the CPU path;
#   4. benchmarks.bulk on 1,008 distinct images (the 84-photo mix), fp16, preprocess gpu_decode,
#      2 bulk processes, no Celery/Redis/Qdrant: model-only fp32 vs fp16, bound, pipeline-only
#      images/s (target ≥ 1,000) with GPU busy %, naive baseline, the cosine table per path;
#   5. benchmarks.previews_gpu: the re-embed from previews (target ≥ 15,000 images/s with the GPU
#      busy ≥ 85 %), cosine of preview-path vectors to original-path vectors;
#   6. the pipeline-only run with preprocess cpu (decode on the CPU), 4 processes;
#   7. benchmarks.matrix on CUDA (30 requests × 50 and × 100 images, batch 16/32/64, preprocess
#      cpu / gpu / gpu_decode), cut by what is left of the budget (it writes each table as it goes).
# NVML and psutil are sampled once a second for the whole run: GPU busy %, the hardware JPEG
# decoder's busy % (nvmlDeviceGetJpgUtilization) and CPU %, summarised per step (and per row of
# step 5) in utilisation.md. Each step has its own time limit, capped by what is left of the
# budget, so the script always ends and returns what it has. Without a GPU it says so ("no GPU:
# CPU rehearsal") and runs the CPU rows at --quick sizes, the previews step through the device
# decode route on the CPU (torchvision's libjpeg: the code path nvImageCodec takes on CUDA).
#
#   bash benchmarks/gpu_check.sh --dry-run   # anywhere, seconds: what would be installed, each step's
#                                            # command and time limit within the budget, the summary
#                                            # (tests/test_gpu_check.py runs it)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [[ "${1:-}" == "--prepare" ]]; then
  set -e
  PY=${PYTHON:-.venv/bin/python}
  DL=var/gpu_check_wheels  # full downloads (git-ignored, never carried)
  mkdir -p .whl "$DL"
  # GPU_CHECK_NO_NVJPEG=1: leave nvJPEG's wheel (3.6 MiB) behind when the tree grows near the limit;
  # nvImageCodec then looks in /usr/local/cuda/lib64 (its RUNPATH), which the device image may hold
  NVJPEG=nvidia-nvjpeg==13.0.4.44
  [[ -z ${GPU_CHECK_NO_NVJPEG:-} ]] || NVJPEG=
  PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
             --platform manylinux2014_x86_64)
  # the GPU image: python3 3.12, CUDA 13.0
  $PY -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DL" open_clip_torch==3.3.0 ftfy==6.3.1 wcwidth==0.9.4 simplejpeg==1.9.0 \
    nvidia-nvimgcodec-cu13==0.9.0.20 $NVJPEG
  rm -f .whl/open_clip_torch-*.whl .whl/ftfy-*.whl .whl/wcwidth-*.whl .whl/simplejpeg-*.whl \
    .whl/nvidia_nvimgcodec_cu13-*.whl .whl/nvidia_nvjpeg-*.whl
  for w in open_clip_torch-3.3.0 ftfy-6.3.1 wcwidth-0.9.4 simplejpeg-1.9.0 ${NVJPEG:+nvidia_nvjpeg-13.0.4.44}; do
    cp "$DL"/$w-*.whl .whl/
  done
  # nvImageCodec's wheel holds its module for eight Pythons and codecs the device route never
  # loads (its backends there are HW_GPU_ONLY, GPU_ONLY, HYBRID_CPU_GPU: workers/device_decode.py):
  # repacked with the cp312 module, libnvimgcodec and the nvJPEG extension, RECORD to match.
  $PY - "$DL"/nvidia_nvimgcodec_cu13-0.9.0.20-*.whl .whl <<'EOF_TRIM'
import sys, zipfile
from pathlib import Path
src = Path(sys.argv[1])
def keep(name: str) -> bool:
    if "/include/" in name or "/tools/dicom/" in name:
        return False
    if "nvimgcodec_impl.cpython-" in name:
        return "nvimgcodec_impl.cpython-312-" in name
    if "/extensions/" in name and not name.endswith("/"):
        return "/libnvjpeg_ext." in name
    return True
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(Path(sys.argv[2]) / src.name, "w", zipfile.ZIP_DEFLATED,
                                                  compresslevel=9) as zout:
    infos = [i for i in zin.infolist() if keep(i.filename)]
    kept = {i.filename for i in infos}
    for i in infos:
        data = zin.read(i.filename)
        if i.filename.endswith(".dist-info/RECORD"):
            data = "".join(line for line in data.decode().splitlines(True)
                           if line.split(",")[0] in kept).encode()
        zout.writestr(i, data, compress_type=zipfile.ZIP_DEFLATED)
print(f"nvImageCodec repacked: {len(kept)} of {len(zin.infolist())} entries, "
      f"{src.stat().st_size / 2**20:.1f} -> {(Path(sys.argv[2]) / src.name).stat().st_size / 2**20:.1f} MiB")
EOF_TRIM
  others=$(ls .whl/*.whl | grep -Ev '/(open_clip_torch|ftfy|wcwidth|simplejpeg|nvidia_nvimgcodec_cu13|nvidia_nvjpeg)-' || true)
  [[ -z $others ]] || echo "note: other wheels in .whl/ travel and install too: $others"
  # the photos once: those samples/ holds byte for byte (tracked: they travel with the tree) are not copied
  chmod -R u+w out/gpu_data 2>/dev/null || true
  rm -rf out/gpu_data
  mkdir -p out/gpu_data/photos
  SRC=../shared/data/images
  (cd $SRC/photos && sha256sum -- *) > out/gpu_data/photos.sha256
  : > out/gpu_data/from_samples.txt
  for f in $SRC/photos/*; do
    n=$(basename "$f")
    if [[ -f samples/$n ]] && cmp -s "$f" "samples/$n"; then
      echo "$n" >> out/gpu_data/from_samples.txt
    else
      cp "$f" out/gpu_data/photos/
    fi
  done
  cp $SRC/MANIFEST.tsv out/gpu_data/
  carried=$(du -sb --apparent-size .whl out/gpu_data | awk '{s += $1} END {print s}')
  tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 stat -c %s 2>/dev/null \
          | awk '{s += $1} END {print s}')
  du -sh --apparent-size .whl out/gpu_data
  awk -v c="$carried" -v t="$tree" -v n="$(wc -l < out/gpu_data/from_samples.txt)" 'BEGIN {
    printf "carried %.1f MiB (.whl + out/gpu_data; %d photos taken from samples/) + working tree %.1f MiB", c / 2^20, n, t / 2^20
    printf " = %.1f MiB of the 64 MiB that may travel\n", (c + t) / 2^20 }'
  (( carried + tree < 60 * 1048576 )) || echo "WARNING: over 60 MiB: the device call may be refused (limit 64 MiB)"
  echo "prepared; on the device: bash benchmarks/gpu_check.sh (carry .whl and out/gpu_data, timeout_s 570)"
  exit 0
fi

DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
OUT=${OUT:-$ROOT/out/gpu_check}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-510}  # the steps end by then; collecting takes seconds (under 9 minutes)
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
exec > >(tee -a "$LOG") 2>&1
echo "== gpu_check $(date -u +%FT%TZ) on $(hostname)"
started=$(date +%s)

# 1. what is missing
if (( DRY_RUN )); then
  echo "dry run: wheels that would be installed from .whl/: $(ls .whl/*.whl 2>/dev/null | xargs -r -n1 basename | tr '\n' ' ')"
elif ! $PY -c "import open_clip, ftfy, simplejpeg, nvidia.nvimgcodec" 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "wheels missing and .whl/ has none: run 'bash benchmarks/gpu_check.sh --prepare' here first"
  elif ! $PY -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))"; then
    echo "the wheels in .whl/ are for the device's Python 3.12; $($PY -V) goes on with what it has"
  else
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  $PY -c "import open_clip, ftfy" || { echo "open_clip is not importable: nothing to measure"; exit 1; }
fi
# the photos: the carried ones and those taken from samples/, checked against their SHA-256
if [[ -f out/gpu_data/photos.sha256 ]]; then
  PHOTOS=/tmp/gpu_check_photos
  rm -rf "$PHOTOS" && mkdir -p "$PHOTOS"
  for f in out/gpu_data/photos/*; do ln -s "$ROOT/$f" "$PHOTOS/"; done
  while read -r n; do ln -s "$ROOT/samples/$n" "$PHOTOS/$n"; done < out/gpu_data/from_samples.txt
  (cd "$PHOTOS" && sha256sum --quiet -c "$ROOT/out/gpu_data/photos.sha256") \
    && echo "photos: $(ls "$PHOTOS" | wc -l) laid out in $PHOTOS, SHA-256 checked" \
    || echo "WARNING: the photos differ from those --prepare recorded (samples/ changed? run --prepare again)"
  export BENCH_PHOTOS=${BENCH_PHOTOS:-$PHOTOS}
fi
export BENCH_PHOTOS=${BENCH_PHOTOS:-$ROOT/../shared/data/images/photos}
# tests/conftest.py reads ../shared/data/images: lay the carried copy out there when it is absent
FULL_ODD=1
if [[ ! -e ../shared/data/images/MANIFEST.tsv && -f out/gpu_data/MANIFEST.tsv ]]; then
  mkdir -p ../shared/data/images \
    && ln -sfn "$BENCH_PHOTOS" ../shared/data/images/photos \
    && cp out/gpu_data/MANIFEST.tsv ../shared/data/images/
fi
[[ $(ls ../shared/data/images/odd 2>/dev/null | wc -l) -ge 76 ]] || FULL_ODD=0
nvidia-smi --query-gpu=name,driver_version,memory.total,utilization.gpu --format=csv 2>/dev/null || echo "no nvidia-smi"
if (( DRY_RUN )) && [[ -n ${GPU_CHECK_ASSUME_CUDA:-} ]]; then
  CUDA=$GPU_CHECK_ASSUME_CUDA  # a dry run told which machine to show: no torch import (seconds, not a minute)
else
$PY - <<'EOF'
import torch, torchvision, open_clip, cv2, psutil
print(f"torch {torch.__version__} torchvision {torchvision.__version__} open_clip {open_clip.__version__} "
      f"opencv {cv2.__version__} cores {psutil.cpu_count()} cuda {torch.cuda.is_available()}"
      + (f" {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
EOF
CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))")
fi
QUICK=""
[[ $CUDA == 1 ]] || { echo "no GPU: CPU rehearsal (the CPU rows only, at --quick sizes)"; QUICK=--quick; }
(( DRY_RUN )) || $PY -c "import nvidia.nvimgcodec as n; print('nvImageCodec', n.__version__)" 2>/dev/null \
  || echo "nvImageCodec: not importable"

# NVML once a second for the whole run: GPU busy %, the hardware JPEG decoder's busy %
# (nvmlDeviceGetJpgUtilization), and CPU % (psutil); summarised per step at the end.
(( DRY_RUN )) || $PY - "$OUT/nvml.csv" <<'EOF_NVML' &
import sys, time, psutil
out = open(sys.argv[1], "w", buffering=1)
out.write("t,cpu_percent,gpu_percent,jpg_percent\n")
try:
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
except Exception:
    h = None
psutil.cpu_percent()
while True:
    time.sleep(1)
    gpu = jpg = ""
    if h is not None:
        gpu = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
        try:
            jpg = pynvml.nvmlDeviceGetJpgUtilization(h)[0]
        except Exception:
            jpg = "n/a"
    out.write(f"{time.time():.0f},{psutil.cpu_percent():.0f},{gpu},{jpg}\n")
EOF_NVML
NVML_PID=$!
STEPS=$OUT/steps.csv
echo "step,t0,t1,exit" > "$STEPS"

step() {  # step NAME SECONDS COMMAND...: at most SECONDS, and never past the budget
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - started) - 12 ))  # 12: --kill-after and the line below
  (( limit <= left )) || limit=$left
  echo; echo "== $name (limit ${limit} s, $(( $(date +%s) - started )) s so far)"
  if (( limit < 15 )); then
    echo "== $name: skipped (the budget of ${BUDGET} s is spent)"; echo "${name//,/;},0,0,skipped" >> "$STEPS"; return
  fi
  local t0 rc; t0=$(date +%s)
  if (( DRY_RUN )); then
    echo "would run: $*"; echo "${name//,/;},$t0,$t0,dry-run" >> "$STEPS"; return
  fi
  timeout --signal=INT --kill-after=10 "$limit" "$@"; rc=$?
  echo "== $name: exit $rc$([[ $rc == 124 ]] && echo ' (its time limit)')"
  echo "${name//,/;},$t0,$(date +%s),$rc" >> "$STEPS"
}

# 2. correctness of every CUDA option (cosine ≥ 0.99 per photo)
# (without the odd files: the EXIF-orientation test, a CPU test, runs at home)
NO_ODD=()
[[ $FULL_ODD == 1 ]] || NO_ODD=(-k "not every_exif_orientation")
step "precision and preprocessing tests" 70 \
  $PY -m pytest -q -p no:cacheprovider -p no:django -o addopts="" tests/workers/test_precision.py "${NO_ODD[@]}"

# 3. the routed decode, less the three CPU tests that read all 76 odd files (the test suite runs
#    them; the odd files do not travel)
step "routing tests" 60 \
  $PY -m pytest -q -p no:cacheprovider -p no:django -o addopts="" tests/workers/test_decode_route.py \
    -k "not test_the_odd_files_route and not test_the_decode_processes_give_the_in_process and not test_simplejpeg_gives"

# 4. bulk: fp16 + the routed decode (baseline JPEGs on the device, the rest in CPU processes),
#    2 processes (the service's default), cosine table per path
step "bulk gpu_decode fp16" 100 \
  $PY -m benchmarks.bulk --no-stack --cosine --images 1008 --model-seconds 4 --naive-images 42 $QUICK \
    --preprocess "$([[ $CUDA == 1 ]] && echo gpu_decode || echo cpu)" --out "$OUT/bulk_gpu_decode"

# 5. the re-embed from previews: the migration chunk task's path, 2 processes; the previews' JPEGs
#    go to the device decoder with gpu_decode (on the CPU, torchvision's: the same route rehearsed)
step "previews re-embed" 90 \
  $PY -m benchmarks.previews_gpu $QUICK $([[ $CUDA == 1 ]] && echo "--preprocess gpu_decode" || echo "--jpeg-device cpu") \
    --seconds 12 --steps-csv "$STEPS" --out "$OUT/previews_gpu"

# 6. bulk: CPU decode, 4 processes (how far CPU decoding feeds the GPU)
step "bulk, CPU decode, 4 processes" 60 \
  $PY -m benchmarks.bulk --no-stack --no-naive --images 1008 --model-seconds 2 --processes 4 $QUICK \
    --out "$OUT/bulk_cpu_decode"

# 7. the experiment's matrix (full size on CUDA; --quick without a GPU): what is left of the
#    budget (its cpu and gpu rows take about 100 s on an H200, the gpu_decode rows more)
step "experiment matrix" 150 \
  $PY -m benchmarks.matrix $QUICK --out "$OUT/matrix"

kill "$NVML_PID" 2>/dev/null
# NVML and CPU per step (avg / max of the 1 s samples inside each step's time)
$PY - "$OUT/nvml.csv" "$STEPS" > "$OUT/utilisation.md" <<'EOF_SUM'
import csv, os, sys
# no samples when the sampler never started (a dry run, a run cut short): the table says "-"
rows = list(csv.DictReader(open(sys.argv[1]))) if os.path.exists(sys.argv[1]) else []
print("| step | exit | s | samples | CPU % avg | GPU % avg | GPU % max | JPEG decoder % avg | JPEG decoder % max |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for s in csv.DictReader(open(sys.argv[2])):
    t0, t1 = int(s["t0"]), int(s["t1"])
    inside = [r for r in rows if t0 <= int(r["t"]) <= t1]
    def col(k):
        v = [float(r[k]) for r in inside if r[k] not in ("", "n/a")]
        return (f"{sum(v) / len(v):.0f}", f"{max(v):.0f}") if v else ("-", "-")
    cpu, gpu, jpg = col("cpu_percent"), col("gpu_percent"), col("jpg_percent")
    print(f"| {s['step']} | {s['exit']} | {t1 - t0} | {len(inside)} | {cpu[0]} | {gpu[0]} | {gpu[1]} | {jpg[0]} | {jpg[1]} |")
EOF_SUM
echo; echo "== utilisation per step (NVML, psutil; 'previews: ...' rows are step 5's measured rows)"
cat "$OUT/utilisation.md"

# The issue's figures in a few lines, from what the steps wrote
$PY - "$OUT" <<'EOF_SUMMARY' | tee "$OUT/summary.md"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("\n## Summary\n")
def load(p):
    try:
        return json.loads((out / p).read_text())
    except (OSError, ValueError):
        return None
for name in ("bulk_gpu_decode", "bulk_cpu_decode"):
    r = load(f"{name}/results.json")
    po = (r or {}).get("pipeline_only")
    if not po:
        print(f"- {name}: no pipeline-only result (cut short or failed; see the log)")
        continue
    gpu = (po["utilisation"].get("gpu_percent") or {}).get("avg")
    cpu = (po["utilisation"].get("cpu_percent") or {}).get("avg")
    ok = ("PASS" if po["images_per_s"] >= 1000 else "FAIL") if r["device"].startswith("cuda") else "n/a, no GPU"
    print(f"- {name} ({r['device']}, {r['precision']}, preprocess {r['preprocess']}, {po['processes']} processes): "
          f"pipeline-only {po['images_per_s']:.1f} images/s on {po['images']} images (target ≥ 1,000: {ok}), "
          f"GPU busy {gpu if gpu is not None else '-'} %, CPU {cpu} %")
    for row in r.get("cosine") or []:
        print(f"  - cosine vs fp32/cpu: {' / '.join(str(x) for x in row)}")
p = load("previews_gpu/results.json")
if p and p.get("target"):
    t, c = p["target"], p["cosine"]
    print(f"- previews ({p['device']}, {p['precision']}, preprocess {p['preprocess']}): service row "
          f"{t['service_images_per_s']:.0f} images/s, best row {t['images_per_s']:.0f} images/s, GPU busy "
          f"{t['gpu_percent'] if t['gpu_percent'] is not None else '-'} % (target ≥ 15,000 with ≥ 85 %: "
          f"{'PASS' if t['pass'] else 'FAIL' if p['device'].startswith('cuda') else 'n/a, no GPU'}); cosine preview vs "
          f"original min {c['cos_min']:.5f} mean {c['cos_mean']:.5f} over {c['images']} photos")
else:
    print("- previews: no result (cut short or failed; see the log)")
EOF_SUMMARY

# Collect: at most 8 files come back. One markdown report, the plots, the JSON in one archive.
{
  cat "$OUT/summary.md"; echo; echo "## Utilisation per step"; cat "$OUT/utilisation.md"
  for f in "$OUT"/bulk_gpu_decode/bulk.md "$OUT"/previews_gpu/previews_gpu.md "$OUT"/bulk_cpu_decode/bulk.md \
           "$OUT"/matrix/matrix.md; do
    [[ -f $f ]] && { echo; echo "<!-- $f -->"; cat "$f"; }
  done
} > "$OUT/gpu_check.md"
for f in bulk_gpu_decode/bulk_throughput.png bulk_gpu_decode/bulk_utilisation.png matrix/matrix_stages.png \
         matrix/matrix_throughput.png; do
  [[ -f $OUT/$f ]] && cp "$OUT/$f" "$OUT/$(dirname "$f")_$(basename "$f")"
done
tar -czf "$OUT/results_json.tar.gz" -C "$OUT" $(cd "$OUT" && ls -d */results.json 2>/dev/null) 2>/dev/null
rm -rf "$OUT"/bulk_gpu_decode "$OUT"/bulk_cpu_decode "$OUT"/previews_gpu "$OUT"/matrix "$OUT"/nvml.csv \
  "$OUT"/steps.csv "$OUT"/summary.md
echo; echo "== done in $(( $(date +%s) - started )) s; in $OUT:"; ls -la "$OUT"
