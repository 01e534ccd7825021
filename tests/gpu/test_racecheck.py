#!/usr/bin/env python3
"""Checks racecheck.py's verdicts on made-up racecheck reports (no GPU needed).

    tests/gpu/test_racecheck.py
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CUBLAS = ("========= Error: Race reported between Read access at nvjet_sm90_tss_64x8_h_bz_NNT+0xb00\n"
          "=========     and Write access at nvjet_sm90_tss_64x8_h_bz_NNT+0x2840 [64 hazards]\n")
OURS = ("========= Warning: Race reported between Write access at void chunkloss::kern::"
        "(anonymous namespace)::row_stats_kernel<float, (bool)1>(chunkloss::kern::TokenParams)+0x1a0\n"
        "=========     and Read access at void chunkloss::kern::(anonymous namespace)::"
        "row_stats_kernel<float, (bool)1>(chunkloss::kern::TokenParams)+0x2c0 [3 hazards]\n")
PASSED = "[doctest] Status: SUCCESS!\n"
FAILED = "[doctest] Status: FAILURE!\n"
INTERNAL = "========= Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception.\n"


def verdict(report, exit_code):
    """racecheck.py's exit code and last line on a tool that prints `report`."""
    tool = [sys.executable, "-c",
            f"import sys; sys.stdout.write({report!r}); sys.exit({exit_code})"]
    run = subprocess.run([sys.executable, os.path.join(HERE, "racecheck.py")] + tool,
                         stdout=subprocess.PIPE, text=True, check=False)
    return run.returncode, run.stdout.strip().splitlines()[-1]


def main():
    cases = [
        # (report, tool exit code, expected racecheck.py exit code, expected text in the verdict)
        (PASSED, 0, 0, "0 hazards in project kernels, 0 in other kernels (none); tests passed"),
        (CUBLAS + CUBLAS + PASSED, 9, 0,
         "0 hazards in project kernels, 128 in other kernels (nvjet_sm90_tss_64x8_h_bz_NNT)"),
        (CUBLAS + OURS + PASSED, 9, 1, "3 hazards in project kernels, 64 in other kernels"),
        (CUBLAS + FAILED, 9, 1, "TESTS DID NOT PASS"),
        (INTERNAL + PASSED, 9, 1, "INTERNAL SANITIZER ERROR"),
        ("", 124, 1, "TESTS DID NOT PASS; tool exit code 124"),
    ]
    bad = 0
    for report, code, want_rc, want_text in cases:
        rc, line = verdict(report, code)
        if rc != want_rc or want_text not in line:
            print(f"FAIL: exit {rc} (want {want_rc}), verdict {line!r} (want {want_text!r})")
            bad += 1
    print(f"{len(cases) - bad} of {len(cases)} verdicts as expected")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
