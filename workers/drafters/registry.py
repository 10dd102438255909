"""Drafters by name: a dict filled by a decorator, so adding a drafter never touches an if/elif chain.

Each drafter module registers itself with `@register_drafter("name")`. `build_drafter(name)` imports
`specd.workers.drafters.<name>` on first use when the name is not registered yet, so heavy drafters (the model
drafter, registered as "model" in workers/drafters/model.py) load only when a config asks for them, and a
new drafter needs no edit here. The n-gram drafter registers as "ngram" (workers/drafters/ngram.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from specd.workers.drafters.base import Drafter

DRAFTERS: dict[str, type[Drafter]] = {}


def register_drafter(name: str) -> Callable[[type[Drafter]], type[Drafter]]:
    """Class decorator: register a Drafter subclass under name and set its `name` attribute."""

    def decorate(cls: type[Drafter]) -> type[Drafter]:
        if not (isinstance(cls, type) and issubclass(cls, Drafter)):
            raise TypeError(f"{cls!r} is not a Drafter subclass")
        existing = DRAFTERS.get(name)
        # Re-registering the same class (a module imported twice under reload) is harmless; a second class
        # under a taken name is a mistake that would silently change which drafter configs get.
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"drafter name {name!r} already registered by {existing.__qualname__}")
        cls.name = name
        DRAFTERS[name] = cls
        return cls

    return decorate


def drafter_class(name: str) -> type[Drafter]:
    """The Drafter subclass registered under name, importing specd.workers.drafters.<name> on first use."""
    if name not in DRAFTERS:
        try:
            importlib.import_module(f"{__package__}.{name}")
        except ModuleNotFoundError as err:
            # Only a missing drafter module means "unknown name"; a missing dependency inside it must surface.
            if err.name != f"{__package__}.{name}":
                raise
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; known: {sorted(DRAFTERS)}")
    return DRAFTERS[name]


def build_drafter(name: str, **cfg: Any) -> Drafter:
    """Build the drafter registered under name with its config keys as keyword arguments."""
    return drafter_class(name)(**cfg)
