"""Where the suite's time goes, from pytest's junit XML (one file per tier, as .ci/run writes them).

    python tests/durations.py .ci/reports/tier1-e2e.xml [more.xml ...] [--top 40] [--markdown] [--merge]

Prints, per file given: per-directory totals (tests/unit, tests/distributed, tests/e2e), per-module
totals, and the slowest tests. A test's time is pytest's total for it (setup + call + teardown), so
a module-scoped fixture (one shared launch) is charged to the first test that uses it.
docs/testing.md's tables are this script's --markdown output.
"""
import argparse
import collections
import sys
import xml.etree.ElementTree as ET


def read(path):
    """junit XML -> [(module path 'tests/unit/test_x.py', test name, seconds, outcome)]."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        # classname is 'tests.unit.test_x' or 'tests.unit.test_x.TestClass'; a module skipped whole (or
        # failing to import) is one case with an empty classname and the module as its name
        module = (case.get("classname") or case.get("name", "")).split(".")
        while module and not module[-1].startswith("test_"):
            module.pop()
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
        rows.append(("/".join(module) + ".py", case.get("name", ""), float(case.get("time", 0.0)), outcome))
    return rows


def table(header, rows, markdown):
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        out = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths))]
        out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def report(path, top, markdown, rows=None):
    rows = read(path) if rows is None else rows
    if not rows:
        raise SystemExit(f"{path}: no <testcase> elements (is it pytest's --junitxml output?)")
    total = sum(r[2] for r in rows)
    by_dir, by_mod = collections.defaultdict(list), collections.defaultdict(list)
    for r in rows:
        by_dir["/".join(r[0].split("/")[:2])].append(r)
        by_mod[r[0]].append(r)

    def summary(groups):
        out = []
        for name, rs in sorted(groups.items(), key=lambda kv: -sum(r[2] for r in kv[1])):
            t = sum(r[2] for r in rs)
            n = collections.Counter(r[3] for r in rs)
            out.append((name, len(rs), n["passed"], n["skipped"], n["failed"], f"{t:.0f}", f"{100 * t / total:.1f}%"))
        return out

    head = ("", "tests", "passed", "skipped", "failed", "seconds", "share")
    print(f"{path}: {len(rows)} tests, {total:.0f} s in tests\n")
    print(table(("directory",) + head[1:], summary(by_dir), markdown), "\n")
    print(table(("module",) + head[1:], summary(by_mod), markdown), "\n")
    slow = sorted(rows, key=lambda r: -r[2])[:top]
    print(table(("#", "test", "seconds", "outcome"),
                [(i + 1, f"{m}::{n}", f"{t:.1f}", o) for i, (m, n, t, o) in enumerate(slow)], markdown))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit", nargs="+", help="pytest --junitxml files")
    p.add_argument("--top", type=int, default=40, help="how many of the slowest tests to list")
    p.add_argument("--markdown", action="store_true", help="markdown tables (docs/testing.md)")
    p.add_argument("--merge", action="store_true", help="one report over all the files given (one tier's phases)")
    a = p.parse_args(argv)
    if a.merge:
        return report(" + ".join(a.junit), a.top, a.markdown, rows=[r for path in a.junit for r in read(path)])
    for i, path in enumerate(a.junit):
        if i:
            print()
        report(path, a.top, a.markdown)


if __name__ == "__main__":
    sys.exit(main())
