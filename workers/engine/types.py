"""Records that cross between the scheduler and the workers.

They are plain dataclasses of Python lists and ints (tensors only where a draft carries q or a result
the target's hidden states), so the same objects travel through Ray's object store or are passed
in-process by the engine benchmark. Words follow the glossary: drafted, accepted, recovered, bonus, step.

Pickled (Ray sends an actor call's arguments and results that way), the per-step records carry their
tensors as numpy arrays (`_NumpyTensors`): torch's own pickling of a small tensor costs 0.17 ms a round
trip on this CPU against numpy's 0.01, paid per request and step on each hop of the hidden states
(target -> router -> drafter) and of q. A tensor comes back on the CPU, in its dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

import torch

from specd.workers.core.sampling import SamplingParams

if TYPE_CHECKING:
    from specd.workers.core.gamma import GammaPolicy, GammaState
    from specd.workers.drafters.base import DraftHint


class _PackedTensor:
    """A tensor as a numpy array and its torch dtype (bfloat16, which numpy lacks, travels as int16 bits)."""

    __slots__ = ("array", "dtype")

    def __init__(self, tensor: torch.Tensor):
        tensor = tensor.detach().cpu()
        self.dtype = str(tensor.dtype).removeprefix("torch.")
        self.array = (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()

    def __getstate__(self) -> tuple:
        return self.array, self.dtype

    def __setstate__(self, state: tuple) -> None:
        self.array, self.dtype = state

    def unpack(self) -> torch.Tensor:
        # an array Ray hands over without a copy is read-only, which a tensor cannot be
        array = self.array if self.array.flags.writeable else self.array.copy()
        tensor = torch.from_numpy(array)
        return tensor.view(torch.bfloat16) if self.dtype == "bfloat16" else tensor


class _NumpyTensors:
    """Pickles a dataclass's tensor fields as numpy arrays (see the module's docstring)."""

    def __getstate__(self) -> dict:
        return {k: _PackedTensor(v) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({k: v.unpack() if isinstance(v, _PackedTensor) else v for k, v in state.items()})


class FinishReason(StrEnum):
    """Why a request ended; the same words in Sequence, the scheduler, metrics and the proto."""

    LENGTH = "length"          # max_new_tokens reached
    EOS = "eos"                # an end-of-sequence token or one of the request's stop token ids
    STOP = "stop"              # a stop string appeared in the text (the router matches text)
    CANCELLED = "cancelled"    # the client cancelled, the deadline passed, or the server stopped
    ERROR = "error"            # a worker failed during the request's step


@dataclass(frozen=True)
class SpecParams:
    """Per-request speculation settings, already clamped to the operator's bounds."""

    gamma: int = 3                # draft length budget (upper bound for the γ policy); = configs spec.gamma
    policy: str = "fixed"         # key of specd.workers.core.gamma.GAMMA_POLICIES
    tree_width: int = 1           # 1 = chain; >1 = token tree with this many first-level children
    enabled: bool = True          # False = target-only decoding (the baseline)

    @classmethod
    def from_config(cls, spec_cfg, enabled: bool | None = None) -> SpecParams:
        """The operator's defaults (configs/schema.py SpecConfig); `enabled` overrides spec.enabled."""
        return cls(gamma=spec_cfg.gamma, policy=spec_cfg.policy, tree_width=spec_cfg.tree_width,
                   enabled=spec_cfg.enabled if enabled is None else enabled)


@dataclass
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    spec: SpecParams = field(default_factory=SpecParams)
    stop_token_ids: tuple[int, ...] = ()
    domain: str = ""              # the client's traffic tag, for replay records ("" = none)
    replay: bool = True           # False: the request leaves no replay record (the client asked)


@dataclass
class DraftItem(_NumpyTensors):
    """Ask the drafter for one step of one request. `commit` carries the previous step's outcome so the
    drafter rolls back and appends the target's tokens in the same call (one round trip per step). The
    scheduler's SpeculationPlanner (workers/engine/planner.py) fills in the plan: γ (a tree's depth), the
    tree's width, the stopping rule, and what the drafter should report for the next plan."""

    request_id: str
    gamma: int                                  # planned draft length (tree: depth); 0 = no drafting
    commit_accepted: int = 0                    # accepted drafts of the previous step
    commit_new_tokens: list[int] = field(default_factory=list)  # accepted drafts + recovered/bonus token
    commit_hidden: torch.Tensor | None = None   # [len(commit_new_tokens), hidden]: VerifyResult.hidden
    width: int = 1                              # tree requests: candidates per level
    # EGAG / confidence: the policy whose keep_drafting stops the draft on the drafter's distribution, and
    # the request's state it reads (its threshold follows ema_acceptance; EGAG updates ema_entropy, which
    # Draft.ema_entropy brings back). None: draft γ tokens.
    stop: GammaPolicy | None = None
    stop_state: GammaState | None = None
    hint_cap: int = 0                           # > 0: report the drafter's DraftHint at this cap (goodput)
    fallback: bool = False                      # planned as a lookup draft: a lookup or nothing, no model


@dataclass
class Draft(_NumpyTensors):
    request_id: str
    """A chain (parents None) or a token tree. For a tree, node 0 is the root (the target's pending
    token, not in `tokens`), node i >= 1 is tokens[i-1], parents has len(tokens) + 1 entries with
    parents[0] = -1, and probs row i-1 is q_child of node i (the distribution node i was drafted from)."""

    tokens: list[int]                           # drafted tokens (len <= planned gamma)
    probs: torch.Tensor | None = None           # [len(tokens), vocab] q, None when drafts are deterministic
    parents: list[int] | None = None            # tree: parent per node (node 0 = root); None = chain
    drafter_version: str = ""
    # What the planner learns from the drafter with the draft (planning data, no costs):
    hint: DraftHint | None = None               # DraftHint before this draft (DraftItem.hint_cap > 0)
    pending: int = 0                            # context a model draft would take in first, after this one
    ema_entropy: float | None = None            # EGAG: the request's entropy EMA after drafting
    draft_seconds: float = 0.0                  # the drafter's forwards of this propose call, whole batch
    # the drafter's weights changed (a hot swap) before this draft: the planner measures the new version's
    # acceptance afresh from its held-out figure (None: unknown)
    version_changed: bool = False
    held_out_acceptance: float | None = None
    held_out_parent: float | None = None        # the version it replaced, on the gate's same records


@dataclass
class VerifyResult(_NumpyTensors):
    request_id: str
    num_drafted: int
    num_accepted: int
    new_tokens: list[int]                       # accepted drafts + one recovered or bonus token
    is_bonus: bool
    accepted_nodes: list[int] | None = None     # tree only: accepted node indices
    depth: int | None = None                    # tree only: its number of levels (chain: None)
    teacher_topk_ids: list[list[int]] | None = None      # [len(new_tokens)][k], for replay records
    teacher_topk_logprobs: list[list[float]] | None = None
    # [len(new_tokens), hidden] float32: the target's final hidden state that predicted each new token;
    # only when the drafter reads target hidden states (verify(..., return_hidden=True))
    hidden: torch.Tensor | None = None
    verify_seconds: float = 0.0                 # wall time of the target's verify call (whole batch)
