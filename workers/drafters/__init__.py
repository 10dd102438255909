"""Drafters behind one interface (base.Drafter), built by name from the registry.

Importing the package registers the light built-in drafters (ngram); the model drafter registers itself
when `build_drafter("model", ...)` first imports specd.workers.drafters.model.
"""

from specd.workers.drafters.base import Drafter, DraftProposal, DraftTree
from specd.workers.drafters.ngram import NGramDrafter
from specd.workers.drafters.registry import DRAFTERS, build_drafter, register_drafter

__all__ = [
    "DRAFTERS",
    "DraftProposal",
    "DraftTree",
    "Drafter",
    "NGramDrafter",
    "build_drafter",
    "register_drafter",
]
