#!/usr/bin/env bash
# Real whisper-base on a CUDA machine (issue 17): the last of the device calls that carried it in parts
# (benchmarks/device_carry.py; the procedure: docs/benchmarks.md, "Real whisper-base on the device").
# Joins .carry/whisper, installs the carried wheels, then times, interleaved, base's generate (eager and
# with transformers' compiled static cache), Transformers' assisted generation (batch 1) and specdec with
# the shipped draft (dynamic, static, every step compiled), constant k = 4 and cost-aware, in float16.
# A dry run on a CPU checks the plumbing (two utterances, batch 1):
#   DRY_RUN=1 PYTHON=.venv/bin/python OMP_NUM_THREADS=1 bash benchmarks/gpu_whisper.sh
set -u
out=${OUT:-gpu_out}
mkdir -p "$out"
exec > >(tee "$out/whisper_log.txt") 2>&1
python3=${PYTHON:-python3}
if [ -z "${DRY_RUN:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$python3" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
carried=${CARRIED:-/tmp/carried}
"$python3" benchmarks/device_carry.py join "${PARTS:-.carry/whisper}" --to "$carried" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$python3" -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
if [ -n "${DRY_RUN:-}" ]; then run=(--device cpu --dtype float32 --limit 2 --batch-sizes 1 --repeats 1
    --contenders base,hf-assisted,specdec,specdec-static)
else run=(--device cuda --dtype float16 --limit "${LIMIT:-24}" --batch-sizes "${BATCHES:-1,4,16}" --repeats "${REPEATS:-3}"
    --contenders "${CONTENDERS:-base,base-static,hf-assisted,specdec,specdec-static,specdec-compile}"); fi
timeout "${WHISPER_S:-420}" "$python3" benchmarks/whisper_real_speed.py --model "$carried/whisper-base" \
    --draft "$carried/whisper-base-draft" --audio-dir "$carried/speech-eval" --policy "${POLICY:-constant:4,cost-aware}" \
    "${run[@]}" --json "$out/whisper_gpu.json"
echo "== done"
