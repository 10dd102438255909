"""An opt-in trace of speculative steps: where a step's time goes, as the process that runs it sees it.

`SPECD_STEP_TRACE=/path/steps.jsonl` in the environment of whatever runs SpecStep (the router under
`specd serve`, the in-process engine under `specd bench engine` or `specd demo`; Ray's workers inherit the
driver's environment) appends one JSON line per step. Off unless set: a step then writes nothing.
`python scripts/step_trace.py FILE` summarises a trace: median propose and verify time by what the step
drafted. The figures are the step's own clocks (StepRecord), so a served step's verify includes the Ray
call to the target and its wait for a CPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from specd.workers.engine.planner import StepRecord

TRACE_ENV = "SPECD_STEP_TRACE"


class StepTrace:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.pid = os.getpid()

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(TRACE_ENV)
        return cls(path) if path else None

    def write(self, record: StepRecord, emitted: int) -> None:
        """One step: `emitted` tokens reached clients (accepted + recovered + bonus, cut at a stop)."""
        line = {
            "pid": self.pid, "started": round(record.started, 6), "batch": record.batch,
            "eligible": record.eligible, "drafted": [len(d.tokens) for d in record.drafts],
            "emitted": emitted, "propose_s": round(record.propose_seconds, 6),
            "verify_s": round(record.verify_seconds, 6), "step_s": round(record.finished - record.started, 6),
            "alone": record.alone,
        }
        # one write of one line in append mode: lines of several processes tracing to one file stay whole
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
