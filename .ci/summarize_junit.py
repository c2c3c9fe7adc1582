"""Sum the JUnit reports of every tests(<member>) session; fail if nothing ran or anything failed.

pytest's own "no tests collected" (exit 5) is turned into a failure by the noxfile; this check
catches the remaining way to pass by running nothing: a run that produced no reports at all.
"""

import pathlib
import sys
import xml.etree.ElementTree as ET


def main(report_dir: str) -> int:
    reports = sorted(pathlib.Path(report_dir).glob("junit-*.xml"))
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for report in reports:
        root = ET.parse(report).getroot()
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        for suite in suites:
            for key in totals:
                totals[key] += int(suite.get(key, 0))
        print(f"ci: {report.name}: {sum(int(s.get('tests', 0)) for s in suites)} tests")
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
