#!/usr/bin/env bash
# The GPU measurements, in one command, at most 9 minutes on one GPU without vLLM (the device image):
# the fused step (bench/fused_step.py) on a random Qwen3-8B shape over tenants 1/8/16/64 x tokens
# 64/256/512 and on the 1.64 B shape at 64 tokens, replayed from CUDA graphs against eager, each with
# its profiles of one 8 x 64 pass (replayed and eager), its host-synchronisation checks and its
# fused-against-alone check; the captured-pass tests (tests/test_cuda_graphs.py, the CUDA one); q/k/v
# and gate/up sharing one shrink against a shrink per layer (bench/shared_shrink.py); LoRA on a MoE base's experts
# (bench/expert_lora.py, Qwen3-30B-A3B's layer shape, 8 layers) against one tenant at a time and
# against PEFT, with its host-synchronisation check. Where vLLM is installed (the gpu
# extra) also the fill benchmark, publish-to-first-token on the 8B shape and suffix speculation on
# and off (arctic-inference). Beside the fused step, the dry run's prediction of its 8 x 64 pass
# (bench/gpu_dryrun.py on the meta device). Prints each benchmark's table and JSON line, then one JSON
# line of all of them. On a machine without a CUDA GPU it says so and exits 0 (nothing to measure).
#
#   bash bench/gpu_suite.sh            (after QUILT_ENGINE=gpu bash scripts/install.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH=. HF_HUB_OFFLINE=1

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_suite: no CUDA GPU here (torch.cuda.is_available() is false); nothing measured"
  echo '{"gpu": false}'
  exit 0
fi
"$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"gpu_suite: {p.name}, {p.total_memory / 2**30:.0f} GiB")'
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

run() {  # name, seconds, command...: the command's output, and its last JSON line kept as $WORK/name.json
  local name=$1 limit=$2; shift 2
  echo; echo "=== $name"
  timeout "$limit" "$@" | tee "$WORK/$name.out"
  local rc=${PIPESTATUS[0]}
  grep '^{' "$WORK/$name.out" | tail -1 > "$WORK/$name.json" || true
  [ -s "$WORK/$name.json" ] || echo "{\"failed\": $rc}" > "$WORK/$name.json"
}

skip() {  # name, why: a benchmark this machine cannot run, said in its JSON line rather than failed
  echo; echo "=== $1: skipped, $2"
  printf '{"skipped": "%s"}\n' "$2" > "$WORK/$1.json"
}

# rank 16: 64 tenants' slabs (weights, gradients, bf16 copies) then take 30 GB beside the 16 GB base;
# micro-batches of 2,048 tokens: about 13 GB of activations, held twice (the graphs' pool beside the
# eager passes), so the 8B grid fits an 80 GB GPU as well as an H200
run fused_8b 330 "$PY" bench/fused_step.py --device cuda --dtype bfloat16 --shape 8b --reps 3 --rank 16 \
  --budget 2048 --sequential-up-to 16
# The same 8 x 64 pass (rank 16) on the meta device (bench/gpu_dryrun.py, no GPU used): its FLOPs
# at 35% and 45% of the spec, to set beside the pass time measured above (the last JSON line's
# "predicted_8x64").
run dryrun_8b 150 "$PY" bench/gpu_dryrun.py --shapes 8b --tenants 8 --tokens 64 --rank 16
# The GPU tests of the fused pass (a real capture and replay against eager, no synchronisation), where
# the image has pytest and the tiny model's tokenizer libraries.
if "$PY" -c 'import pytest, tokenizers' 2>/dev/null; then
  run gpu_tests 120 bash -c "\"$PY\" -m pytest -q -p no:cacheprovider --noconftest -k gpu tests/test_cuda_graphs.py tests/test_fused_step.py \
    && echo '{\"passed\": true}' || echo '{\"passed\": false}'"
else
  skip gpu_tests "pytest or tokenizers is not installed"
fi
run fused_1_6b 120 "$PY" bench/fused_step.py --device cuda --dtype bfloat16 --shape 1.6b --tokens 64 --reps 5
# q/k/v and gate/up sharing one shrink against a shrink per layer (two copies of the 1.64 B base)
run shared_shrink 90 "$PY" bench/shared_shrink.py --device cuda --dtype bfloat16 --shape 1.6b --tenants 1,8 \
  --tokens 64,512 --reps 5
run expert_lora 100 "$PY" bench/expert_lora.py --device cuda --dtype bfloat16 --shape 30b-a3b-8l --tenants 1,8 \
  --tokens 64,256 --reps 3
# A trainer gang against one GPU: only where there are two to split the base over.
if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  run gang 240 "$PY" bench/gang_step.py --device cuda --ranks 2 --hidden 4096 --layers 8 --tenants 8 --tokens 512
else
  skip gang "one GPU: a gang needs two"
fi
# The other three drive vLLM's CUDA engine. A machine that has the GPU but not the gpu extra (an
# image without vLLM and no registry to fetch it from) still measures the trainer.
if "$PY" -c 'import vllm' 2>/dev/null; then
  run fill 150 "$PY" bench/genpool_fill.py --async --mix mixed --groups 32 --pause 6 --run-for 10 --repeats 2 --publish-trials 2
  run first_token 170 "$PY" bench/first_token.py --preset qwen3-8b --trials 5 --workdir "$WORK"
  run suffix 120 "$PY" bench/suffix_speculation.py --engine
else
  for name in fill first_token suffix; do skip "$name" "vllm is not installed (the gpu extra)"; done
fi

echo
"$PY" - "$WORK" <<'PY'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
out = {n: json.loads((work / f"{n}.json").read_text()) for n in ("fused_8b", "dryrun_8b", "gpu_tests", "fused_1_6b", "shared_shrink", "expert_lora", "gang", "fill", "first_token", "suffix")}
# the dry run's prediction of the 8 x 64 pass beside the GPU's measurement of it
measured = out["fused_8b"].get("grid", {}).get("8x64", {})
predicted = out["dryrun_8b"].get("shapes", {}).get("8b", {})
if measured and predicted:
    out["predicted_8x64"] = {"measured_pass_ms": measured.get("pass_ms"), "measured_eager_ms": measured.get("eager_pass_ms"),
                             "predicted_ms": predicted.get("ms_at"), "flops_per_pass": predicted.get("flops_per_pass")}
print(json.dumps({"gpu": True, **out}))
PY
