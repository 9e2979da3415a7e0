"""Compare two junit XML reports: every test that passes in the first must pass in the second.

``python compare.py NAME STOCK.xml KCACHE.xml [KCACHE2.xml ...]`` prints one JSON line:
the outcome counts of each report and the tests that pass in the stock run but not in
another (with the first line of their failure), and exits 1 when there are any.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    """Test id -> (outcome, first line of the message)."""
    found: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = child.tag, (child.get("message") or "").splitlines()[:1]
                message = message[0] if message else ""
                break
            if child.tag == "skipped":
                kind = child.get("type") or ""
                outcome = "xfailed" if "xfail" in kind else "skipped"
        found[test] = (outcome, message[:300] if isinstance(message, str) else "")
    return found


def main() -> int:
    name, stock_path, *others = sys.argv[1:]
    stock = outcomes(stock_path)
    report: dict[str, object] = {
        "suite": name,
        "stock": dict(Counter(o for o, _ in stock.values())),
    }
    bad = 0
    for path in others:
        run = outcomes(path)
        lost = {
            t: run.get(t, ("missing", ""))
            for t, (o, _) in stock.items()
            if o == "passed" and run.get(t, ("missing", ""))[0] != "passed"
        }
        gained = [
            t for t, (o, _) in run.items() if o == "passed" and stock.get(t, ("",))[0] != "passed"
        ]
        bad += len(lost)
        report[path] = {
            "counts": dict(Counter(o for o, _ in run.values())),
            "passed_stock_not_here": {t: list(v) for t, v in lost.items()},
            "passed_here_not_stock": gained,
        }
    print(json.dumps(report))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
