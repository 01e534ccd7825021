#!/usr/bin/env python3
"""Every doctest case of the given suites has a name ctest can run on its own.

    check_test_names.py SUITE...

doctest_discover_tests registers each case under its name, and CMake splits a name at ';' (a
list separator): each piece became a test that matched no case, ran nothing and passed, while the
case itself never ran under ctest. An unbalanced '[' or ']' breaks the generated add_test call,
and with it every test of the suite. (Commas are escaped by the discovery.)"""
import subprocess
import sys

bad = []
for suite in sys.argv[1:]:
    out = subprocess.run([suite, "--list-test-cases"], capture_output=True, text=True, check=True)
    names = [l for l in out.stdout.splitlines() if l and not l.startswith(("[doctest]", "==="))]
    if not names:
        bad.append("%s: no test cases listed" % suite)
    bad += ["%s: %r" % (suite, n) for n in names
            if ";" in n or n.count("[") != n.count("]") or n.find("]") < n.find("[")]
if bad:
    print("FAIL: test case names ctest cannot run on their own (';', unbalanced brackets):\n" +
          "\n".join(bad))
    sys.exit(1)
print("%d suites: every test case name can be run by ctest" % len(sys.argv[1:]))
