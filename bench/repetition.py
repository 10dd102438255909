"""The repetition workload (`--workloads repeat`): what agents and coding tools send, the same prompts
again with small edits.

Eval prompts of GSM8K and HumanEval, alternating, each followed at once by an edited copy: a GSM8K
question with its first number raised by one, a HumanEval stub with a comment line added on top. The
target's answer to the copy repeats much of its answer to the original, which a drafter that learns from
served traffic (drafter.kind=suffix) can draft from; nothing in the copy's own prompt holds that answer,
so per-request drafters (n-gram, model) gain nothing special. Order matters: run it at batch 1 (or the
copy may start before the original finished) and report how many accepted tokens came from the global
index (the specd runner records the suffix drafter's sources per cell).
"""

from __future__ import annotations

import re
from dataclasses import replace

EDITED = 1_000_000   # added to an edited copy's row index: its seed and its id differ from the original's


def edit(prompt):
    """The small edit of one specd.workers.prompts.Prompt."""
    if prompt.source == "gsm8k":
        text = re.sub(r"\d+", lambda m: str(int(m.group()) + 1), prompt.text, count=1)
    else:
        text = "# revised\n" + prompt.text
    return replace(prompt, text=text)


def repetition_prompts(num_prompts: int, tokenizer) -> list[tuple[int, list[int]]]:
    """(row index, token ids) of num_prompts prompts: originals each followed by their edited copy."""
    from specd.workers.prompts import encode_prompt, load_split

    sources = [load_split("gsm8k", "eval"), load_split("humaneval", "eval")]
    out = []
    for k in range(max(1, num_prompts // 2)):
        original = sources[k % 2][k // 2]
        out.append((original.index, encode_prompt(tokenizer, original)))
        out.append((EDITED + original.index, encode_prompt(tokenizer, edit(original))))
    return out[:max(num_prompts, 2)]
