#!/usr/bin/env bash
# The CLIP GPU benchmark (bench/gpu.py, as `bench/run.py --only gpu` runs it) in one go on a lent GPU
# machine that has python3 with torch but no network: `bash bench/gpu_device.sh` from the repo root.
# Installs the wheels carried in .whl/ (what the machine lacks, and transformers 4.x with its hub and
# tokenizers, shadowing the machine's transformers 5) into /tmp/site, prints the GPU and the versions,
# runs ViT-B/32 then ViT-L/14 and writes $OUT/gpu.json (rewritten after each model: a model that fails
# or a run cut short still leaves the models before it) and $OUT/gpu.log. Ends within DEADLINE seconds.
#
# Overrides (for a CPU smoke test here): PY, WHL_DIR, SITE, DEADLINE, GPU_BENCH_SETTINGS (JSON merged
# over the defaults below).
set -u -o pipefail

OUT=${OUT:-/tmp/gpu_bench_out}
mkdir -p "$OUT"
PY=${PY:-python3}
WHL_DIR=${WHL_DIR:-.whl}
SITE=${SITE:-/tmp/site}
DEADLINE=${DEADLINE:-460}
JSON="$OUT/gpu.json"
LOG="$OUT/gpu.log"

main() {
  echo "== $(date -u +%FT%TZ) $(hostname 2>/dev/null) $(uname -m), $(nproc) CPUs, cwd $PWD"
  echo "== pip install $WHL_DIR into $SITE"
  ls -1 "$WHL_DIR"/*.whl
  timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHL_DIR"/*.whl || echo "!! pip install failed (rc $?)"
  export PYTHONPATH="$SITE:$PWD:$PWD/bench"
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    WANDB_MODE=disabled HF_HOME=/tmp/hf_home

  echo "== nvidia-smi"
  timeout 20 nvidia-smi || echo "!! nvidia-smi failed (rc $?)"

  echo "== versions"
  timeout 90 "$PY" - <<'EOF' || echo "!! version check failed (rc $?)"
import importlib, os, sys
print("python", sys.version.split()[0], sys.executable)
for m in ("torch", "torchvision", "transformers", "tokenizers", "huggingface_hub", "safetensors", "accelerate",
          "numpy", "pandas", "pyarrow", "PIL", "cv2", "simplejpeg", "pydantic", "typing_extensions", "fsspec",
          "pkg_resources", "clip", "all_clip"):
    try:
        mod = importlib.import_module(m)
        print(f"{m:16} {getattr(mod, '__version__', '-'):24} {mod.__file__}")
    except Exception as e:  # noqa: BLE001
        print(f"{m:16} FAILED {type(e).__name__}: {e}")
import torch
print("cuda", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-",
      "bf16", torch.cuda.is_available() and torch.cuda.is_bf16_supported())
from shardprep.embeddings import thread_split
print("cores (affinity)", len(os.sched_getaffinity(0)), "decode threads (cuda)", thread_split("cuda")[0])
EOF

  local left=$((DEADLINE - SECONDS - 15))
  local settings
  settings=$("$PY" -c 'import json, sys
s = {"work": "/tmp/gpu_bench_work", "samples": 20000, "per_tar": 2000, "device": "cuda",
     "out": sys.argv[1], "keep_going": True}
s.update(json.loads(sys.argv[2] or "{}"))
print(json.dumps(s))' "$JSON" "${GPU_BENCH_SETTINGS:-}")
  echo "== benchmark ($left s left): $settings"
  local rc=0
  timeout -k 10 "$left" "$PY" bench/gpu.py --json "$settings" || rc=$?
  echo "== benchmark exit code $rc (124: cut at the deadline) after ${SECONDS}s"
  timeout 20 "$PY" - "$JSON" "$rc" "$SECONDS" <<'EOF'
import json, os, sys
path, rc, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    with open(path) as f:
        out = json.load(f)
except (OSError, ValueError) as e:
    out = {"error": f"no result written ({type(e).__name__}: {e})"}
out.update({"exit_code": rc, "script_seconds": secs})
with open(path, "w") as f:
    json.dump(out, f, indent=2)
print(json.dumps(out, indent=2))
EOF
  return "$rc"
}

main 2>&1 | tee "$LOG"
