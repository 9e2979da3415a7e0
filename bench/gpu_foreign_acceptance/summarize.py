"""Sum the plugins' per-process counters of one run: ``python summarize.py DIR TAG``.

Prints one JSON line: the totals over the run's processes (``compile:*`` what CuPy or
Triton really compiled, ``kcache:*`` what kcache's lookups and writes did, ``unshared:*``
compiles kept off the fleet, by reason), how many tests reached kcache, and the tests
that looked kcache up and still compiled (with their counters).
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections import Counter


def main() -> int:
    directory, tag = sys.argv[1:3]
    totals: Counter[str] = Counter()
    reached, compiled_anyway, compiled_off_kcache = 0, {}, []
    flushed = []
    for path in sorted(glob.glob(os.path.join(directory, f"{tag}*.json"))):
        with open(path) as f:
            data = json.load(f)
        totals.update(data.get("totals", {}))
        flushed.append(data.get("flushed"))
        for test, counts in data.get("tests", {}).items():
            looked = any(k.startswith("kcache:") for k in counts)
            compiles = sum(
                v
                for k, v in counts.items()
                if (k.startswith("compile:") and not k.endswith(":preprocess")) or k == "put_group"
            )
            reached += looked
            if looked and compiles:
                compiled_anyway[test] = counts
            elif compiles:
                compiled_off_kcache.append(test)
    print(
        json.dumps(
            {
                "run": tag,
                "processes_flushed": flushed,
                "totals": dict(sorted(totals.items())),
                "tests_that_looked_kcache_up": reached,
                "tests_that_looked_up_and_compiled": compiled_anyway,
                "tests_that_compiled_without_kcache": len(compiled_off_kcache),
                "examples_compiled_without_kcache": compiled_off_kcache[:8],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
