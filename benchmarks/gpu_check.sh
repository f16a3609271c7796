#!/usr/bin/env bash
# The GPU check of issue 5 in one short run (< 9 minutes on one H200; run it with timeout_s=570),
# everything under $OUT.
#
#   bash benchmarks/gpu_check.sh --prepare   # HERE, once: wheels open_clip needs (.whl/) and the
#                                            # photos + manifest (out/gpu_data/); both git-ignored
#   bash benchmarks/gpu_check.sh             # THERE (device run, carry [".whl", "out/gpu_data"])
#
# On the GPU machine it:
#   1. installs the missing pure-Python wheels (open_clip_torch, ftfy, wcwidth) from .whl/ into
#      /tmp/site (that machine reaches no registry; torch, torchvision, OpenCV, Pillow, psutil,
#      nvidia-ml-py, matplotlib are already there);
#   2. runs tests/workers/test_precision.py: every precision (fp32/bf16/fp16) × preprocessing
#      (cpu/gpu/gpu_decode) on CUDA within cosine 0.99 of fp32 on each of the 84 photos;
#   3. benchmarks.bulk on 1,008 distinct images, fp16, preprocess gpu_decode, 2 bulk processes, no
#      Celery/Redis/Qdrant there: model-only fp32 vs fp16, per-image costs and bound,
#      pipeline-only images/s with GPU busy % (NVML, 1 s), naive baseline, cosine table;
#   4. the same pipeline-only run with preprocess cpu (decode on the CPU), 4 processes;
#   5. benchmarks.matrix on CUDA: 30 requests × 50 and × 100 images, batch 16/32/64, preprocess
#      cpu / gpu / gpu_decode, fp16, with the per-stage min/max/avg tables and GPU busy %.
# Each step has its own time limit, so the script always ends and returns what it has. Without a
# GPU it says so, and runs the CPU rows only (steps 2-3 skip their CUDA parts).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [[ "${1:-}" == "--prepare" ]]; then
  set -e
  PY=${PYTHON:-.venv/bin/python}
  mkdir -p .whl out/gpu_data/odd
  $PY -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
    open_clip_torch==3.3.0 ftfy==6.3.1 wcwidth==0.9.4
  cp -r ../shared/data/images/photos out/gpu_data/
  cp ../shared/data/images/MANIFEST.tsv out/gpu_data/
  cp ../shared/data/images/odd/jpeg_exif_orientation_*Landscape_*.jpg out/gpu_data/odd/
  du -sh .whl out/gpu_data
  echo "prepared; on the device: bash benchmarks/gpu_check.sh (carry .whl and out/gpu_data)"
  exit 0
fi

OUT=${OUT:-$ROOT/out/gpu_check}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
exec > >(tee -a "$LOG") 2>&1
echo "== gpu_check $(date -u +%FT%TZ) on $(hostname)"
started=$(date +%s)

# 1. what is missing
if ! $PY -c "import open_clip, ftfy" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "open_clip is missing and .whl/ has no wheels: run 'bash benchmarks/gpu_check.sh --prepare' here first"
    exit 1
  fi
fi
export BENCH_PHOTOS=${BENCH_PHOTOS:-$ROOT/out/gpu_data/photos}
[[ -d $BENCH_PHOTOS ]] || BENCH_PHOTOS=$ROOT/../shared/data/images/photos
# tests/conftest.py reads ../shared/data/images: lay the carried copy out there when it is absent
if [[ ! -e ../shared/data/images/MANIFEST.tsv && -f out/gpu_data/MANIFEST.tsv ]]; then
  mkdir -p ../shared/data/images \
    && ln -sfn "$ROOT/out/gpu_data/photos" ../shared/data/images/photos \
    && ln -sfn "$ROOT/out/gpu_data/odd" ../shared/data/images/odd \
    && cp out/gpu_data/MANIFEST.tsv ../shared/data/images/
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,utilization.gpu --format=csv 2>/dev/null || echo "no nvidia-smi"
$PY - <<'EOF'
import torch, torchvision, open_clip, cv2, psutil
print(f"torch {torch.__version__} torchvision {torchvision.__version__} open_clip {open_clip.__version__} "
      f"opencv {cv2.__version__} cores {psutil.cpu_count()} cuda {torch.cuda.is_available()}"
      + (f" {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
EOF
CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))")
QUICK=""
[[ $CUDA == 1 ]] || { echo "NO CUDA DEVICE: running the CPU rows only, at --quick sizes"; QUICK=--quick; }

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo; echo "== $name (limit ${limit} s, $(( $(date +%s) - started )) s so far)"
  timeout --signal=INT --kill-after=10 "$limit" "$@"
  echo "== $name: exit $?"
}

# 2. correctness of every CUDA option (cosine ≥ 0.99 per photo)
step "precision and preprocessing tests" 80 \
  $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/workers/test_precision.py

# 3. bulk: fp16 + nvJPEG, 2 processes (the service's default), cosine table
step "bulk gpu_decode fp16" 100 \
  $PY -m benchmarks.bulk --no-stack --cosine --images 1008 --model-seconds 4 --naive-images 42 $QUICK \
    --preprocess "$([[ $CUDA == 1 ]] && echo gpu_decode || echo cpu)" --out "$OUT/bulk_gpu_decode"

# 4. bulk: CPU decode, 4 processes (how far CPU decoding feeds the GPU)
step "bulk, CPU decode, 4 processes" 60 \
  $PY -m benchmarks.bulk --no-stack --no-naive --images 1008 --model-seconds 2 --processes 4 $QUICK \
    --out "$OUT/bulk_cpu_decode"

# 5. the experiment's matrix (full size on CUDA; --quick without a GPU). On the H200 (2026-12-04)
#    the cpu and gpu rows fitted in 100 s and the gpu_decode rows took 133 s more (nvJPEG is slow)
step "experiment matrix" 260 \
  $PY -m benchmarks.matrix $QUICK --out "$OUT/matrix"

# Collect: at most 8 files come back. One markdown report, the plots, the JSON in one archive.
{
  for f in "$OUT"/bulk_gpu_decode/bulk.md "$OUT"/bulk_cpu_decode/bulk.md "$OUT"/matrix/matrix.md; do
    [[ -f $f ]] && { echo; echo "<!-- $f -->"; cat "$f"; }
  done
} > "$OUT/gpu_check.md"
for f in bulk_gpu_decode/bulk_throughput.png bulk_gpu_decode/bulk_utilisation.png matrix/matrix_stages.png \
         matrix/matrix_throughput.png; do
  [[ -f $OUT/$f ]] && cp "$OUT/$f" "$OUT/$(dirname "$f")_$(basename "$f")"
done
tar -czf "$OUT/results_json.tar.gz" -C "$OUT" $(cd "$OUT" && ls -d */results.json 2>/dev/null) 2>/dev/null
rm -rf "$OUT"/bulk_gpu_decode "$OUT"/bulk_cpu_decode "$OUT"/matrix
echo; echo "== done in $(( $(date +%s) - started )) s; in $OUT:"; ls -la "$OUT"
