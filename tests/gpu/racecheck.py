#!/usr/bin/env python3
"""Runs a compute-sanitizer racecheck command line and judges its report.

    tests/gpu/racecheck.py COMMAND...   (e.g. compute-sanitizer --tool racecheck ... TEST_BINARY)

The tool's output is passed through, then one verdict line follows:

    racecheck: P hazards in project kernels, O in other kernels (K, ...); tests passed

It exits 0 only when no hazard is in a project kernel (namespace chunkloss), the tool raised no
internal error and the test binary passed (doctest's "Status: SUCCESS!"). Hazards in other
kernels are counted and named, not judged: with asynchronous-copy tracking off
(--racecheck-memcpy-async no), cuBLAS's Hopper GEMMs show hazards between their TMA copies and
the reads that wait for them on mbarriers, which the tool then does not follow.
"""
import re
import subprocess
import sys

# "Error: Race reported between Write access at KERNEL+0x10" and, on the next line,
# "and Read access at KERNEL+0x20 [8 hazards]"; warnings alike.
ACCESS = re.compile(r"(?:Race reported between|and) \w+ access at (.+?)\+0x[0-9a-f]+")
COUNT = re.compile(r"\[(\d+) hazards?\]")


def main(argv):
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    run = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         errors="replace", check=False)
    sys.stdout.write(run.stdout)
    project = 0
    others = {}
    report_kernels = []
    for line in run.stdout.splitlines():
        m = ACCESS.search(line)
        if m:
            report_kernels.append(m.group(1))
        c = COUNT.search(line)
        if c and report_kernels:
            n = int(c.group(1))
            if any("chunkloss" in k for k in report_kernels):
                project += n
            else:
                for k in sorted(set(report_kernels)):
                    others[k] = others.get(k, 0) + n
            report_kernels = []
    internal = "Internal Sanitizer Error" in run.stdout
    passed = "[doctest] Status: SUCCESS!" in run.stdout
    names = ", ".join(sorted(others)) if others else "none"
    print(f"racecheck: {project} hazards in project kernels, {sum(others.values())} in other "
          f"kernels ({names}); " + ("tests passed" if passed else "TESTS DID NOT PASS") +
          ("; INTERNAL SANITIZER ERROR" if internal else "") + f"; tool exit code {run.returncode}")
    return 0 if project == 0 and passed and not internal else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
