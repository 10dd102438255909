"""Replay a recorded stream through the online trainer, offline, to choose its settings.

The online trainer (drafter_trainer/online.py) sees records in stream order and trains every
`update_every_records`; this script feeds it the records of a Redis stream in the same order, without a
server, and scores the candidate after each update round on held-out records of each domain (the gate's
expected acceptance Σ min(p, q) at the first γ positions, and greedy match: what greedy traffic
accepts). Every record is teacher-labelled once and the labelled records are shared by all the settings
tried (`--labels PATH` keeps them for the next run), so comparing settings costs training time only.

    python scripts/osd_replay.py --redis redis://127.0.0.1:6399 \
        --drafter ~/.cache/specd/drafters/boot-quick-hidden \
        --try trainer.lr=1e-4 --try trainer.lr=5e-4,trainer.steps_per_update=32

Records come from any run with replay on and `replay.redis_url` set (e.g. `specd bench osd --modes off
replay.redis_url=...`). Prints one table row per update round and setting.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from specd.configs import load_config
from specd.drafter_trainer.gate import score
from specd.drafter_trainer.online import OnlineTrainer
from specd.drafter_trainer.online_data import (
    Example,
    TargetTeacher,
    is_held_out,
    make_example,
    trainer_dtype,
    with_prompt_weight,
)
from specd.drafter_trainer.replay_source import RECORD_FIELD
from specd.proto.replay_codec import decode_record
from specd.workers.models.loader import ensure_target_model


class _NoSource:
    """The trainer's replay source, for a trainer that is fed by hand."""

    def ensure_group(self) -> None:
        pass

    def ack(self, ids) -> None:
        pass


def load_records(url: str, stream: str) -> list[tuple[str, object]]:
    import redis

    r = redis.Redis.from_url(url)
    return [(eid.decode(), decode_record(fields[RECORD_FIELD])) for eid, fields in r.xrange(stream)]


def label_all(records, teacher, cfg, need_hidden: bool):
    out = []
    for eid, rec in tqdm(records, desc="teacher labels", unit="rec"):
        ex = make_example(eid, rec, teacher, positions=cfg.positions, accepted_weight=cfg.accepted_weight,
                          need_hidden=need_hidden, chain=cfg.gate_gamma, prompt_weight=1.0)
        if ex is not None:
            out.append(ex)
    return out


def add_prompt_labels(examples: list[Example], teacher) -> list[Example]:
    """Label the prompt positions of examples labelled without them (label files of earlier runs)."""
    out = []
    for e in tqdm(examples, desc="prompt labels", unit="rec"):
        if e.n_prompt_labels == 0 and e.first_label > 0:
            lp, ix, _ = teacher.label(e.token_ids.tolist(), 0, False)
            k = e.first_label
            e = replace(e, first_label=0, topk_logprobs=torch.cat([lp[:k], e.topk_logprobs]),
                        topk_ids=torch.cat([ix[:k], e.topk_ids]),
                        weights=torch.cat([torch.ones(k), e.weights]),
                        step_position=torch.cat([torch.arange(k) % 4, e.step_position]),
                        in_step=torch.cat([torch.zeros(k, dtype=torch.bool), e.in_step]), n_prompt_labels=k)
        out.append(e)
    return out


def replay(examples, setting: list[str], base_overrides: list[str], target_dir: str, drafter: str,
           teacher, final_steps: int = 0, heldout_eval=None) -> list[dict]:
    """One setting: the stream's examples in order through the trainer; a row per update round.
    final_steps: that many more steps on the whole buffer after the stream (what the same records give a
    trainer with compute to spare). heldout_eval(store, after): scores the versions in process."""
    cfg = load_config([*base_overrides, *setting]).trainer
    if heldout_eval is not None:
        cfg = replace(cfg, keep_versions=1_000_000)   # the version serving at a domain's end is scored
    examples = [with_prompt_weight(e, cfg.prompt_weight) for e in examples]
    holdout = {}
    for e in examples:
        if is_held_out(e.entry_id, cfg.holdout_every):
            holdout.setdefault(e.domain, []).append(e)
    with tempfile.TemporaryDirectory() as store:
        trainer = OnlineTrainer(cfg, _NoSource(), target_dir, drafter, store, teacher=teacher)
        rows = [_row(trainer, holdout, cfg.gate_gamma, 0)]
        new = 0
        after: dict[str, str] = {}   # domain -> the version serving after its last record
        for i, e in enumerate(examples, 1):
            if is_held_out(e.entry_id, cfg.holdout_every):
                trainer.holdout.append(e)
            else:
                trainer.buffer.append(e)
                new += 1
            if new >= cfg.update_every_records:
                rows.append(_round(trainer, cfg.steps_per_update, holdout, cfg.gate_gamma, i))
                new = 0
            after[e.domain] = trainer.serving_version
        if final_steps:
            rows.append(_round(trainer, final_steps, holdout, cfg.gate_gamma, len(examples)))
        if heldout_eval is not None:
            rows.append({"heldout": heldout_eval(Path(store), after)})
    return rows


def _round(trainer, steps: int, holdout, gamma: int, seen: int) -> dict:
    t0 = time.perf_counter()
    trainer.train_steps(steps)
    train_s = time.perf_counter() - t0
    trainer.gate_and_publish()
    return {**_row(trainer, holdout, gamma, seen), "train_s": round(train_s, 1)}


def _row(trainer, holdout, gamma: int, seen: int) -> dict:
    """Per domain: the candidate's expected acceptance and greedy match, and the serving version's."""
    row = {"records": seen, "publishes": trainer.stats.publishes}
    for domain, held in holdout.items():
        cand, serv = score(trainer.candidate, held, gamma), score(trainer.serving, held, gamma)
        row[domain] = (round(cand.expected_acceptance, 4), round(cand.greedy_match, 4))
        row[f"{domain}/serving"] = (round(serv.expected_acceptance, 4), round(serv.greedy_match, 4))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--redis", required=True)
    p.add_argument("--stream", default="specd:replay")
    p.add_argument("--labels", default=None, metavar="PATH",
                   help="labelled records: read when the file exists, else written")
    p.add_argument("--drafter", required=True, help="the drafter the stream's server started from")
    p.add_argument("--try", dest="settings", action="append", default=[],
                   help="comma-separated trainer overrides; repeat for each setting")
    p.add_argument("--max-records", type=int, default=None, help="only the stream's first N records")
    p.add_argument("--final-steps", type=int, default=0,
                   help="after the stream, this many more steps on the whole buffer")
    p.add_argument("--heldout", type=int, default=0, metavar="N",
                   help="also score the versions as `specd bench osd` does: α of γ-chains on N eval prompts "
                        "per domain, in process, before / after each domain / final")
    p.add_argument("--gamma", type=int, default=3, help="--heldout: the chains' γ")
    p.add_argument("--max-new-tokens", type=int, default=40, help="--heldout: tokens per eval prompt")
    p.add_argument("overrides", nargs="*", default=[])
    args = p.parse_args()
    cfg = load_config(args.overrides)
    target_dir = str(ensure_target_model(cfg.target.model_path, cfg.cache_dir))
    teacher = TargetTeacher(target_dir, top_k=cfg.trainer.teacher_topk,
                            dtype=trainer_dtype(str(cfg.trainer.dtype), str(cfg.trainer.device)))
    labels = Path(args.labels) if args.labels else None
    if labels and labels.is_file():
        examples = [Example(**e) for e in torch.load(labels, weights_only=True)]
        if any(e.n_prompt_labels == 0 for e in examples):
            examples = add_prompt_labels(examples, teacher)
            torch.save([dict(e.__dict__) for e in examples], labels)
    else:
        records = load_records(args.redis, args.stream)
        print(f"{len(records)} records")
        examples = label_all(records, teacher, replace(cfg.trainer), need_hidden=True)
        if labels:
            torch.save([dict(e.__dict__) for e in examples], labels)
    examples = examples[:args.max_records]
    print(f"{len(examples)} labelled records")
    heldout_eval = None
    if args.heldout:
        from specd.bench.osd import heldout_acceptance

        def heldout_eval(store: Path, after: dict[str, str]) -> dict:
            return heldout_acceptance([*args.overrides, f"drafter.path={args.drafter}", "drafter.kind=model"],
                                      store, args.heldout, args.max_new_tokens, after, gamma=args.gamma)
    for setting in args.settings or [""]:
        overrides = [s for s in setting.split(",") if s]
        for row in replay(examples, overrides, args.overrides, target_dir, str(Path(args.drafter)), teacher,
                          args.final_steps, heldout_eval):
            print(setting or "defaults", row, flush=True)


if __name__ == "__main__":
    main()
