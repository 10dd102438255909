"""What `specd serve` shows a person: one line per phase of start-up on the console, and everything else
(specd's INFO, Ray's, transformers', gRPC core's, the actors' output) in a log file.

On the console, only records of specd's own loggers: the phase lines (`phase()`), and warnings and
errors. Third-party records go to the file: a gRPC fork notice or a Ray warning about the thread that
called ray.init is nothing a user can act on. `--verbose` puts every record on the console again, in
the full format, and lets gRPC core and the libraries' progress bars speak as they would.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

PHASE_LOGGER = "specd.phase"
FULL_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_started = time.monotonic()


def quiet_native_libraries() -> None:
    """For a quiet `specd serve`, before grpc is imported (gRPC core reads these once): its fork handlers
    (and their INFO notice at every fork while its threads run: Ray and redis-server start as children)
    are off, and what it logs below ERROR is not printed. A value the user set wins."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


class _Console(logging.Filter):
    """specd's phase lines and specd's warnings; nothing of other libraries."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == PHASE_LOGGER:
            return True
        ours = record.name == "specd" or record.name.startswith("specd.")
        return ours and record.levelno >= logging.WARNING


class _ConsoleFormat(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        if record.name == PHASE_LOGGER:
            return f"specd: {record.getMessage()}"
        text = f"specd {record.levelname.lower()}: {record.getMessage()}"
        return text + " (the traceback is in the log file)" if record.exc_info else text


def default_log_file(cache_dir: str | None) -> Path:
    from specd.workers.models.loader import default_cache_dir

    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(cache_dir or default_cache_dir()) / "logs" / f"serve-{stamp}-{os.getpid()}.log"


def setup(verbose: bool, log_file: Path | None) -> Path | None:
    """Root logging for `specd serve`: the console (stderr) as the module says, and every record at INFO
    in log_file (None: no file). Returns the log file."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    console = logging.StreamHandler(sys.stderr)
    if verbose:
        console.setFormatter(logging.Formatter(FULL_FORMAT))
    else:
        console.addFilter(_Console())
        console.setFormatter(_ConsoleFormat())
    root.addHandler(console)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        to_file = logging.FileHandler(log_file, encoding="utf-8")
        to_file.setFormatter(logging.Formatter(FULL_FORMAT))
        root.addHandler(to_file)
    logging.captureWarnings(True)       # warnings.warn of any library: a record of py.warnings
    if not verbose:
        _quiet_transformers()
        _no_progress_bars()
    return log_file


def _no_progress_bars() -> None:
    """No tqdm bar in this process: transformers draws one for a GGUF conversion of seconds with plain
    tqdm (its progress-bar switch does not reach it), and torch imports tqdm before any setting could be
    read; the phase lines say what runs. Keyword defaults of every bar's __init__, subclasses included."""
    from functools import partialmethod

    import tqdm.std

    if not getattr(tqdm.std.tqdm, "_specd_quiet", False):
        tqdm.std.tqdm.__init__ = partialmethod(tqdm.std.tqdm.__init__, disable=True)
        tqdm.std.tqdm._specd_quiet = True


def _quiet_transformers() -> None:
    """transformers logs through a handler of its own and draws progress bars for a GGUF conversion of
    seconds: its records go to the root handlers (the file), its bars nowhere."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()


def quiet_ray_logger(verbose: bool) -> None:
    """Before ray.init (which warns as it starts): Ray's driver-side logger goes through the root handlers
    (the log file) instead of the stderr handler Ray gives it at import. With verbose nothing changes."""
    if verbose:
        return
    import ray  # noqa: F401 (its import configures the "ray" logger, which is undone here)

    ray_log = logging.getLogger("ray")
    for handler in list(ray_log.handlers):
        ray_log.removeHandler(handler)
    ray_log.propagate = True


def route_actor_output(verbose: bool) -> None:
    """After ray.init: the actors' output (log_to_driver) goes to the log file, each line under the
    actor's name, instead of being printed on the console. With verbose nothing changes."""
    if verbose:
        return
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:          # another Ray: its own printing stays
        return
    actors = logging.getLogger("ray.actors")

    def to_file(data: dict) -> None:
        who = data.get("actor_name") or data.get("task_name") or "worker"
        for line in data.get("lines", ()):
            actors.info("(%s pid=%s) %s", who, data.get("pid"), line)

    dispatcher.remove_handler("ray_print_logs")
    dispatcher.remove_handler("specd_log_file")
    dispatcher.add_handler("specd_log_file", to_file)


def phase(message: str, *args) -> None:
    """One line of start-up on the console ("specd: ..."), with the seconds since the process began."""
    logging.getLogger(PHASE_LOGGER).info(f"{message} ({time.monotonic() - _started:.0f} s)", *args)
