"""How a worker's config settings (dtype, decode) resolve on its device, and the process-wide attention
backend choice for CUDA: the settings ModelRunner is built with."""

from __future__ import annotations

import torch

DECODE_MODES = ("eager", "static", "graph", "compiled")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """A config dtype; "auto" is bfloat16 on CUDA (half the bytes of each weight read) and float32
    elsewhere (faster than bfloat16 for the target on the CPUs tried: docs/decisions/cpu-kernels.md)."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)} or auto")
    return DTYPES[name]


def resolve_decode(name: str, device: str | torch.device) -> str:
    """A config decode mode; "auto": compiled on CUDA (docs/decisions/compiled-decode.md), else eager."""
    if name == "auto":
        return "compiled" if torch.device(device).type == "cuda" else "eager"
    return name


def prefer_shape_free_attention() -> None:
    """Take cuDNN out of SDPA's backends (process-wide). torch 2.11 sends masked SDPA on an H100 to cuDNN
    first, which builds an execution plan for every new shape: ~20 ms of host time per attention call
    whose length it has not seen. Prefills and a drafter's catch-up have a new length almost every
    call, so each paid it (docs/gpus.md, 2026-11-26); the other backends take any length."""
    torch.backends.cuda.enable_cudnn_sdp(False)
