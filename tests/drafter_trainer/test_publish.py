"""Publishing is crash-safe and survives a full disk: files and directories are fsynced before and after
each rename, a pinned version is never pruned and an unpublished one cannot be pinned, and a publish
into a full filesystem leaves CURRENT on a good version while the trainer goes on."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specd.drafter_trainer.drafter_format import load_drafter
from specd.drafter_trainer.publish import VersionStore
from specd.workers.drafters.versions import (
    VersionError,
    load_version,
    read_current,
    read_pin,
    target_checksum,
    version_dir,
    write_pin,
)
from tests.drafter_trainer.online_helpers import make_tiny_drafter


@pytest.fixture(scope="module")
def drafter(tiny_llama_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_llama_dir, tmp_path_factory.mktemp("drafter"))


def _publish(store: VersionStore, drafter: Path, tiny_llama_dir: Path, **kw) -> str:
    state, config, _ = load_drafter(drafter)
    state = {k: (v + torch.randn_like(v) * 0.01 if v.is_floating_point() else v) for k, v in state.items()}
    checksum = target_checksum(tiny_llama_dir)
    return store.publish(state, config, version=None, parent=None, target_checksum=checksum, **kw)


def test_files_and_directories_are_synced_around_each_rename(tmp_path, tiny_llama_dir, drafter, monkeypatch):
    store = VersionStore(tmp_path / "store")
    trace: list[tuple[str, str]] = []
    fsync, rename, replace_ = os.fsync, os.rename, os.replace

    def traced_fsync(fd):
        trace.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def traced(op, real):
        def call(src, dst):
            trace.append((op, f"{src} -> {dst}"))
            real(src, dst)
        return call

    monkeypatch.setattr(os, "fsync", traced_fsync)
    monkeypatch.setattr(os, "rename", traced("rename", rename))
    monkeypatch.setattr(os, "replace", traced("replace", replace_))
    version = _publish(store, drafter, tiny_llama_dir)
    root, vdir = str(store.root), str(version_dir(store.root, version))
    ops = [op for op, _ in trace]
    moved = ops.index("rename")                        # the version directory into versions/
    tmp_dir = trace[moved][1].split(" -> ")[0]
    synced_before = {path for op, path in trace[:moved] if op == "fsync"}
    assert {f"{tmp_dir}/model.safetensors", f"{tmp_dir}/config.json", f"{tmp_dir}/specd_drafter.json",
            tmp_dir} <= synced_before
    assert trace[moved + 1] == ("fsync", f"{root}/versions")             # the rename itself
    current = next(i for i, (op, arg) in enumerate(trace) if op == "replace" and arg.endswith("/CURRENT"))
    assert current > moved + 1                          # CURRENT only once the version is on disk
    assert trace[current - 1][0] == "fsync" and "CURRENT.tmp" in trace[current - 1][1]
    assert trace[current + 1] == ("fsync", root)
    assert read_current(store.root) == version and Path(vdir).is_dir()


def test_a_pinned_version_is_never_pruned_and_an_unpublished_one_cannot_be_pinned(tmp_path, tiny_llama_dir,
                                                                                  drafter):
    store = VersionStore(tmp_path / "store", keep=2)
    first = _publish(store, drafter, tiny_llama_dir)
    with pytest.raises(VersionError, match="not published"):
        write_pin(store.root, "online-9999-deadbeef")
    assert read_pin(store.root) is None
    write_pin(store.root, first)
    later = [_publish(store, drafter, tiny_llama_dir) for _ in range(4)]
    assert first in store.versions()                    # pinned: kept though it is the oldest of 5
    assert later[0] not in store.versions() and store.versions()[-2:] == later[-2:]
    write_pin(store.root, None)
    _publish(store, drafter, tiny_llama_dir)
    assert first not in store.versions()                # unpinned: pruned like any old version


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs (needs root and mount; skipped where neither is possible)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("a size-limited tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path, leave: int) -> Path:
    """A file taking all but `leave` bytes of the filesystem at `path`."""
    st = os.statvfs(path)
    filler = path / "filler"
    size = max(0, st.f_bavail * st.f_frsize - leave)
    with open(filler, "wb") as f:
        f.write(b"\0" * size)
    return filler


@pytest.mark.slow
def test_disk_full_while_publishing_keeps_a_good_current_and_the_trainer_goes_on(
        small_fs, tiny_llama_dir, drafter, tmp_path):
    from specd.cluster.redis_server import ManagedRedis
    from specd.drafter_trainer.online import OnlineTrainer
    from specd.drafter_trainer.online_data import TargetTeacher, make_example
    from specd.drafter_trainer.replay_source import ReplaySource
    from tests.drafter_trainer.online_helpers import greedy_continuations, make_record
    from tests.drafter_trainer.test_online import CFG

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    cfg = replace(CFG, gate_margin=-1.0)                # every candidate passes the gate
    teacher = TargetTeacher(tiny_llama_dir, top_k=8, max_seq_len=128)
    with ManagedRedis() as server:
        source = ReplaySource(server.endpoint.client(), "s-full", cfg.group, cfg.consumer)
        trainer = OnlineTrainer(cfg, source, tiny_llama_dir, drafter, small_fs / "store", teacher=teacher)
        base = trainer.serving_version
        examples = [make_example(f"{i}-0", make_record(i, p, o, base), teacher, positions="all",
                                 accepted_weight=0.2, need_hidden=False)
                    for i, (p, o) in enumerate(greedy_continuations(tiny_llama_dir, 6, new_tokens=12))]
        trainer.holdout.extend(examples[:2])
        trainer.buffer.extend(examples[2:])
        filler = _fill(small_fs, leave=4096)            # less than a version's weights
        assert trainer.update() is None                 # the publish failed: no exception
        assert trainer.stats.publish_failures == 1 and trainer.stats.events[-1]["event"] == "publish_failed"
        assert trainer.stats.checkpoint_failures == 1
        assert read_current(trainer.store.root) == base == trainer.serving_version
        load_version(version_dir(trainer.store.root, base), tiny_llama_dir)   # still whole and verified
        assert trainer.store.versions() == [base]
        assert not [p for p in (trainer.store.root / "versions").iterdir() if p.name.startswith(".tmp")]
        filler.unlink()                                 # space again: the trainer goes on and publishes
        version = trainer.update()
        assert version is not None and read_current(trainer.store.root) == version
        load_version(version_dir(trainer.store.root, version), tiny_llama_dir)
