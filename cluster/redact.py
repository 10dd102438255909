"""Secrets never leave the server: masking for what ServerInfo, metrics, logs and errors show.

The running config holds Redis URLs (`redis://user:password@host:port/0`, `rediss://...?password=...`)
and names of token files and variables; anything shown to a client, a log or a metric label goes
through `redact_text` first. Token values themselves never enter the config (only file paths and
variable names do), so the URL credentials and secret-looking query parameters are what can leak.
"""

from __future__ import annotations

import logging
import re

MASK = "***"

# scheme://[user][:password]@  -> the password (if any) masked, the user kept (it is not a secret and
# helps an operator tell which account a URL uses)
_URL_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:/@\s]*)(?P<sep>:)?"
                           r"(?P<password>[^@/\s]*)@")
# ?password=...&token=... style query parameters (redis-py reads password= from a URL's query)
_SECRET_PARAM = re.compile(r"(?P<key>[?&;](?:[A-Za-z_]*(?:password|passwd|token|secret|key)[A-Za-z_]*)=)"
                           r"(?P<value>[^&;#\s]*)", re.IGNORECASE)


def _userinfo(m: re.Match) -> str:
    if m.group("sep") is None:              # scheme://user@host: no password given
        if not m.group("user"):
            return m.group(0)
        # a lone user part is how some URLs carry a token (redis://<token>@host): mask it
        return f"{m.group('head')}{MASK}@"
    return f"{m.group('head')}{m.group('user')}:{MASK}@"


def redact_text(text: str) -> str:
    """`text` with every URL password and secret-named query parameter replaced by ***."""
    if "://" not in text and "=" not in text:
        return text
    text = _URL_USERINFO.sub(_userinfo, text)
    return _SECRET_PARAM.sub(lambda m: f"{m.group('key')}{MASK}", text)


def redact_config(config: dict[str, str]) -> dict[str, str]:
    """A flattened config (configs.flatten) fit to show to a client or export as labels."""
    return {key: redact_text(value) for key, value in config.items()}


class RedactingFilter(logging.Filter):
    """A handler filter that masks URL credentials in every record it passes, tracebacks included: a
    net under the call sites, which already mask what they log."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        return True


def install_log_redaction(logger: logging.Logger | None = None) -> None:
    """Put a RedactingFilter on every handler of `logger` (the root logger by default)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
