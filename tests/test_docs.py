"""README.md and docs/: generated tables match their JSON, every cited file exists, every result file is
cited, and no text names a numbered work session."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A repository path in backticks or a link. A path right after "207ad13:" is a git object (a file that
# left the tree, read with `git show`), not a file of the tree.
TREE_PATH = re.compile(
    r"(?<![\w:./-])((?:bench|cluster|configs|data|docker|docs|drafter_trainer|helm|proto|scripts|tests|workers)"
    r"/[\w./-]*\w\.(?:py|sh|md|jsonl|json|png|proto|yaml|txt|tpl))(?!\w)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def load_tables():
    spec = importlib.util.spec_from_file_location("results_tables", ROOT / "scripts" / "results_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLES = load_tables()
DOCS = TABLES.doc_files()


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _hidden(path: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(ROOT).parts)


def _linked(doc: Path, text: str) -> list[str]:
    """The repository paths a doc's relative links point at."""
    return [_rel((doc.parent / t).resolve()) for t in LINK.findall(text) if "://" not in t]


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_generated_tables_match_their_json(doc: Path) -> None:
    text = doc.read_text()
    assert TABLES.render(text) == text, f"{_rel(doc)}: stale table: python scripts/results_tables.py"


def test_a_changed_number_is_caught(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    assert "<!-- table:" in readme
    body_start = readme.index("-->", readme.index("<!-- table:")) + 4
    edited = readme[:body_start] + readme[body_start:].replace("x [", "x  [", 1)
    assert TABLES.render(edited) != edited


def test_every_cited_file_exists() -> None:
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for path in TREE_PATH.findall(text):
            if not (ROOT / path).exists():
                missing.append(f"{_rel(doc)}: {path}")
        for target in _linked(doc, text):
            if not (ROOT / target).exists():
                missing.append(f"{_rel(doc)}: link to {target}")
        for marker in TABLES.MARKER.finditer(text):
            missing += [f"{_rel(doc)}: table source {s}" for s in TABLES.sources(marker["spec"])
                        if not (ROOT / s).is_file()]
    assert not missing, missing


def test_every_result_file_is_cited() -> None:
    text = "\n".join(doc.read_text() for doc in DOCS)
    cited = set(TREE_PATH.findall(text))
    for doc in DOCS:
        cited |= set(_linked(doc, doc.read_text()))
    for marker in TABLES.MARKER.finditer(text):
        cited |= set(TABLES.sources(marker["spec"]))
    results = {_rel(p) for p in (ROOT / "bench" / "results").iterdir() if p.is_file()}
    assert not results - cited, f"result files cited by no doc (git rm them): {sorted(results - cited)}"


def test_code_cites_existing_docs() -> None:
    missing = []
    for path in ROOT.rglob("*"):
        if path.suffix not in (".py", ".proto", ".sh", ".yaml") or _hidden(path):
            continue
        for cited in re.findall(r"docs/[\w./-]*\w\.md", path.read_text(errors="replace")):
            if not (ROOT / cited).is_file():
                missing.append(f"{_rel(path)}: {cited}")
    assert not missing, missing


def test_no_numbered_sessions() -> None:
    pattern = re.compile(r"session [0-9]", re.I)
    hits = [_rel(p) for p in ROOT.rglob("*") if p.suffix in (".py", ".md") and not _hidden(p)
            and pattern.search(p.read_text(errors="replace"))]
    assert not hits, hits


def test_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


KERNELS = [   # (a kernel's name as the profiler gives it, cut at 160 characters; as the table shows it)
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::Tensor"
     "IteratorBase&)::{lambda()#3}::operator(", "unrolled_elementwise_kernel<direct_copy_kernel_cuda>"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor<float, float, "
     "float, at::native::binary_internal::MulF", "vectorized_elementwise_kernel"),   # cut mid-name
    ("void at::native::(anonymous namespace)::indexSelectSmallIndex<c10::BFloat16, long, unsigned "
     "int, -1, -1, -1>(at::cuda::detail::Ten", "indexSelectSmallIndex"),
    ("std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, float>", "gemvx::kernel"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::b",
     "fmha_cutlassF_bf16_aligned_64x64_rf_sm80"),
    ("triton_per_fused__fused_rms_norm_0", "triton_per_fused__fused_rms_norm_0"),
]


@pytest.mark.parametrize("raw,shown", KERNELS)
def test_kernel_names_keep_what_a_kernel_computes(raw: str, shown: str) -> None:
    assert TABLES.kernel_name(raw) == shown
