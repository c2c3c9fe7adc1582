"""Sum the JUnit reports of every tests(<member>) session; fail if nothing ran or anything failed.

pytest's own "no tests collected" (exit 5) is turned into a failure by the noxfile; this check
catches the remaining way to pass by running nothing: a run that produced no reports at all.

Before the totals it prints where the time went, so that every change sees its cost: each nox
session's wall time (``session-*.json``, written by the noxfile) and the slowest tests.
"""

import json
import pathlib
import sys
import xml.etree.ElementTree as ET

SLOWEST = 15


def _suites(report: pathlib.Path) -> list[ET.Element]:
    root = ET.parse(report).getroot()
    return [root] if root.tag == "testsuite" else list(root.iter("testsuite"))


def print_time(report_dir: pathlib.Path) -> None:
    sessions = [json.loads(p.read_text()) for p in sorted(report_dir.glob("session-*.json"))]
    total = sum(s["wall_s"] for s in sessions)
    for s in sorted(sessions, key=lambda s: -s["wall_s"]):
        print(f"ci: time: {s['wall_s']:7.1f} s  {s['session']}")
    if sessions:
        print(f"ci: time: {total:7.1f} s  all {len(sessions)} sessions")
    cases = []
    for report in sorted(report_dir.glob("junit-*.xml")):
        member = report.stem.removeprefix("junit-")
        for suite in _suites(report):
            for case in suite.iter("testcase"):
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                cases.append((float(case.get("time", 0.0)), member, name))
    cases.sort(reverse=True)
    for seconds, member, name in cases[:SLOWEST]:
        print(f"ci: slowest: {seconds:7.1f} s  {member}  {name}")


def main(report_dir: str) -> int:
    reports = sorted(pathlib.Path(report_dir).glob("junit-*.xml"))
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for report in reports:
        suites = _suites(report)
        for suite in suites:
            for key in totals:
                totals[key] += int(suite.get(key, 0))
        print(f"ci: {report.name}: {sum(int(s.get('tests', 0)) for s in suites)} tests")
    print_time(pathlib.Path(report_dir))
    failed = totals["failures"] + totals["errors"]
    passed = totals["tests"] - failed - totals["skipped"]
    print(f"ci: {len(reports)} reports")
    print(f"tests: {passed} passed, {failed} failed, {totals['skipped']} skipped")
    if not reports or totals["tests"] == 0:
        print("ci: no tests ran", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".ci-reports"))
