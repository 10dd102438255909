"""When each drafter version served during a `specd bench osd` stream: from the requests' own records
(the versions that drafted them) and the trainer's version store (when each version was published)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path


def swap_events(rows: list[dict | None]) -> list[dict]:
    """The first request (by index) drafted by each version after the first one."""
    seen: set[str] = set()
    events = []
    for r in rows:
        for v in (r or {}).get("versions", []):
            if v not in seen:
                if seen:
                    events.append({"index": r["index"], "version": v})
                seen.add(v)
    return events


def serving_at_domain_end(rows: list[dict | None], store: Path | None = None,
                          swap_delay_s: float = 0.0) -> dict[str, str]:
    """The drafter version serving when each domain's stream segment ended.

    With the trainer's `store`: the newest version published at least `swap_delay_s` before the
    segment's last request finished (the server polls the store and applies a version between steps).
    Without it, or when the store's CURRENT is not its newest version (a rollback, whose time the store
    does not keep): the version that drafted the segment's last drafted request. That one alone
    understates: where the goodput policy stopped drafting with the model drafter, the last version to
    draft may have been replaced long before (docs/decisions/osd-evaluation.md)."""
    drafted: dict[str, str] = {}
    ended: dict[str, float] = {}
    for r in rows:
        if r and r.get("versions"):
            drafted[r["domain"]] = r["versions"][-1]
        if r and "done_at" in r:
            ended[r["domain"]] = max(ended.get(r["domain"], 0.0), r["done_at"])
    from specd.workers.drafters.versions import read_current

    published = _published_times(store) if store is not None else []
    if not published or published[-1][1] != read_current(store):
        return drafted
    out = dict(drafted)
    for domain, end in ended.items():
        live = [v for t, v in published if t <= end - swap_delay_s]
        if live:
            out[domain] = live[-1]
    return out


def published_events(rows: list[dict | None], store: Path, swap_delay_s: float) -> list[dict]:
    """Each version the trainer published during the stream, at the first request that finished at least
    `swap_delay_s` after it was published: when it served, whether or not the model drafter then drafted
    (`swap_events` sees only versions that drafted). `records_seen`: the records the trainer had read when
    it published the version; the requests finished by then, less that, are how far behind it was."""
    from specd.workers.drafters.versions import VERSIONS_DIR, read_meta

    done = sorted((r["done_at"], r["index"]) for r in rows if r and "done_at" in r)
    events = []
    for t, version in _published_times(store):
        meta = read_meta(Path(store) / VERSIONS_DIR / version)
        if meta.get("parent_version") is None:
            continue                                # the starting drafter, published at start-up
        later = [i for d, i in done if d >= t + swap_delay_s]
        if later:
            events.append({"index": later[0], "version": version,
                           "records_seen": meta.get("records_seen"),
                           "requests_done": sum(1 for d, _ in done if d <= t)})
    return events


def _published_times(store: Path) -> list[tuple[float, str]]:
    """(publish time, version) of every version in the store, oldest first (`created` has whole seconds:
    each is taken as published at the end of its second)."""
    from specd.workers.drafters.versions import VERSIONS_DIR, read_meta

    out = []
    root = Path(store) / VERSIONS_DIR
    for vdir in root.iterdir() if root.is_dir() else []:
        created = read_meta(vdir).get("created") if vdir.is_dir() and not vdir.name.startswith(".") else None
        if created:
            out.append((dt.datetime.fromisoformat(created).timestamp() + 1.0, vdir.name))
    return sorted(out)
