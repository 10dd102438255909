"""The online trainer's precision (trainer.dtype): float32 against bfloat16 on recorded records.

Measures, on one thread (what a SCHED_IDLE trainer beside serving gets at best on a 2-core host):
  - the teacher forward per record, and how far bfloat16 labels are from float32 ones: the share of
    positions with the same top-1 token, KL(float32 || bfloat16) over float32's top-k, and the relative
    error of the hidden states the hidden-state drafter reads;
  - one optimizer step of `trainer.batch_records` records, float32 and under bfloat16 autocast.

    python scripts/trainer_precision.py --labels /tmp/rec/labels.pt --records 40

--labels: a file `scripts/osd_replay.py --labels` wrote (its records' token ids are relabelled here).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from specd.configs import load_config
from specd.drafter_trainer.online import OnlineTrainer
from specd.drafter_trainer.online_data import Example, TargetTeacher
from specd.drafter_trainer.teacher import cache_root
from specd.workers.models.loader import ensure_target_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class _NoSource:
    def ensure_group(self) -> None:
        pass

    def ack(self, ids) -> None:
        pass


def label_check(examples: list[Example], target_dir: str, top_k: int) -> dict:
    teachers = {name: TargetTeacher(target_dir, top_k=top_k, dtype=dt) for name, dt in DTYPES.items()}
    seconds = {name: [] for name in DTYPES}
    same = positions = 0
    kls, hidden_err = [], []
    for e in examples:
        out = {}
        for name, teacher in teachers.items():
            t0 = time.perf_counter()
            out[name] = teacher.label(e.token_ids.tolist(), e.first_label, True)
            seconds[name].append(time.perf_counter() - t0)
        (lp32, ix32, st32), (lp16, ix16, st16) = out["float32"], out["bfloat16"]
        same += int((ix32[:, 0] == ix16[:, 0]).sum())
        positions += ix32.shape[0]
        # bfloat16's log-probability of each of float32's top-k ids; outside its own top-k, its k-th value
        lp16_at = lp16[:, -1:].expand_as(lp32).clone()
        match = ix32.unsqueeze(-1) == ix16.unsqueeze(-2)  # [n, k, k]
        found = match.any(-1)
        lp16_at[found] = (lp16.unsqueeze(-2) * match).sum(-1)[found]
        kls.append(float((lp32.exp() * (lp32 - lp16_at)).sum(-1).mean()))
        a, b = st32.float(), st16.float()
        hidden_err.append(float(((a - b).norm(dim=-1) / a.norm(dim=-1)).mean()))
    return {"records": len(examples), "positions": positions, "top1_agreement": same / positions,
            "kl_top_k": statistics.mean(kls), "hidden_relative_error": statistics.mean(hidden_err),
            "label_s_per_record": {n: statistics.median(s) for n, s in seconds.items()}}


def step_check(examples: list[Example], target_dir: str, drafter: str, steps: int, repeats: int) -> dict:
    cfg = load_config([]).trainer
    out: dict[str, list[float]] = {name: [] for name in DTYPES}
    with tempfile.TemporaryDirectory() as store:
        for name in DTYPES:
            trainer = OnlineTrainer(cfg, _NoSource(), target_dir, drafter, store, teacher=object())
            trainer.dtype = DTYPES[name]
            trainer.buffer.extend(examples)
            trainer.train_steps(2)                          # warm-up: allocations, oneDNN kernels
            for _ in range(repeats):
                t0 = time.perf_counter()
                trainer.train_steps(steps)
                out[name].append((time.perf_counter() - t0) / steps)
    return {"step_s": {n: statistics.median(v) for n, v in out.items()}, "batch_records": cfg.batch_records}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--labels", required=True, metavar="PATH")
    p.add_argument("--records", type=int, default=40, help="records spread over the file")
    p.add_argument("--drafter", default=str(cache_root() / "drafters" / "boot-quick-hidden"))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = str(ensure_target_model())
    examples = [Example(**e) for e in torch.load(args.labels, weights_only=True)]
    picked = examples[:: max(1, len(examples) // args.records)][: args.records]
    labels = label_check(picked, target_dir, load_config([]).trainer.teacher_topk)
    print(f"teacher forward, {labels['records']} records, {labels['positions']} positions, {args.threads} "
          f"thread(s): float32 {labels['label_s_per_record']['float32']:.3f} s/record, bfloat16 "
          f"{labels['label_s_per_record']['bfloat16']:.3f} s/record")
    print(f"bfloat16 labels vs float32: same top-1 {labels['top1_agreement']:.4f}, KL over the top-k "
          f"{labels['kl_top_k']:.5f} nats, hidden states' relative error "
          f"{labels['hidden_relative_error']:.4f}")
    steps = step_check(picked, target_dir, args.drafter, args.steps, args.repeats)
    print(f"optimizer step of {steps['batch_records']} records: float32 {steps['step_s']['float32']:.3f} s, "
          f"bfloat16 autocast {steps['step_s']['bfloat16']:.3f} s (median of {args.repeats} x {args.steps})")


if __name__ == "__main__":
    main()
