"""Against the previous run: each group's headwise time now against the same group's headwise time in the
``results.json`` the run is about to overwrite, and the rows that got slower by more than 2 %.

The ratio is ``now median / previous median`` of the same entry of the same group (same case, group and
entry name). Times from two runs on a shared machine are only indicative (other jobs, another process
layout); the goals are the paired ratios, measured side by side within one run. This table is a tripwire
for a change that made headwise itself slower, to be confirmed by a rerun.

Shapes:
    none: this module handles result dictionaries, not tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["THRESHOLD", "read_previous", "compare_with_previous", "regression_lines"]

#: A headwise row is listed when it takes more than this times its previous median.
THRESHOLD = 1.02


def read_previous(path: str | Path) -> dict | None:
    """The earlier ``results.json`` at ``path``, or None when there is none (or it does not parse)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _headwise_times(groups: list[dict]) -> dict[tuple[str, str, str], float]:
    return {(g["case"], g["group"], e["name"]): e["median_s"] for g in groups for e in g["entries"]
            if e["role"].startswith("headwise")}


def compare_with_previous(previous: dict | None, groups: list[dict], *, quick: bool,
                          threshold: float = THRESHOLD) -> dict:
    """Every headwise entry of ``groups`` that is also in ``previous`` (an earlier ``results.json``), and the
    ones slower than ``threshold`` times their previous median, slowest first.

    Example:
        >>> g = lambda t: [{"case": "c", "group": "g", "entries": [{"name": "headwise", "role": "headwise",
        ...                                                          "median_s": t}]}]
        >>> old = {"machine": {"quick": False, "command": "x", "date_utc": "then"}, "groups": g(1.0)}
        >>> cmp = compare_with_previous(old, g(1.03), quick=False)
        >>> cmp["compared"], [round(r["ratio"], 2) for r in cmp["slower"]]
        (1, [1.03])
        >>> compare_with_previous(old, g(1.01), quick=False)["slower"]
        []
    """
    out: dict = {"threshold": threshold, "compared": 0, "new": 0, "slower": [], "previous": None, "skipped": ""}
    if previous is None:
        out["skipped"] = "no previous results.json"
        return out
    m = previous.get("machine", {})
    out["previous"] = {"command": m.get("command", "?"), "date_utc": m.get("date_utc", "?")}
    if bool(m.get("quick")) != quick:
        out["skipped"] = "the previous run used other sizes (--quick in one run only)"
        return out
    before = _headwise_times(previous.get("groups", []))
    for (case, group, name), now in _headwise_times(groups).items():
        then = before.get((case, group, name))
        if then is None or then <= 0:
            out["new"] += 1
            continue
        out["compared"] += 1
        if now / then > threshold:
            out["slower"].append({"case": case, "group": group, "entry": name, "previous_s": then, "now_s": now,
                                  "ratio": now / then})
    out["slower"].sort(key=lambda r: -r["ratio"])
    return out


def regression_lines(cmp: dict) -> list[str]:
    """Markdown lines of the comparison (a heading, what it compares, and a table of the slower rows).

    Example:
        >>> print("\\n".join(regression_lines({"threshold": 1.02, "compared": 3, "new": 0, "slower": [],
        ...     "previous": {"command": "x", "date_utc": "then"}, "skipped": ""})[2:3]))
        No headwise row is more than 2 % slower than in the previous results.json (3 rows compared).
    """
    pct = f"{100 * (cmp['threshold'] - 1):.0f} %"
    lines = ["## Against the previous results.json", ""]
    if cmp["skipped"]:
        return lines + [f"Not compared: {cmp['skipped']}.", ""]
    p = cmp["previous"]
    note = (f"headwise's median time per group now / in the previous `results.json` (`{p['command']}`, "
            f"{p['date_utc']}), listed where it is more than {pct} slower. Times from different runs on a shared "
            "machine are only indicative; the goals are the paired ratios above, measured side by side in one run.")
    if not cmp["slower"]:
        return lines + [f"No headwise row is more than {pct} slower than in the previous results.json "
                        f"({cmp['compared']} rows compared).", "", note, ""]
    lines += [note, "", f"{len(cmp['slower'])} of {cmp['compared']} rows compared are slower by more than {pct}"
              + (f" ({cmp['new']} rows are new)." if cmp["new"] else "."), "",
              "| case | group | entry | previous ms | now ms | now / previous |",
              "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['case']} | {r['group']} | {r['entry']} | {r['previous_s'] * 1e3:.3f} | {r['now_s'] * 1e3:.3f} "
              f"| {r['ratio']:.3f} |" for r in cmp["slower"]]
    return lines + [""]
