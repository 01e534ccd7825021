#!/usr/bin/env python3
"""Generates the bundled data in apps/data/: two-number addition, a task with one checkable answer.

Every example is a prompt "A+B=" with A and B in 0..99 and the answer str(A + B), byte-level text
(so the byte tokenizer's vocabulary suffices). The files follow TRL's dataset conventions:

  sft_train.jsonl / sft_eval.jsonl    {"prompt": "12+34=", "completion": "46"}
  pref_train.jsonl / pref_eval.jsonl  {"prompt": "12+34=", "chosen": "46", "rejected": "56"}
  kto_train.jsonl / kto_eval.jsonl    {"prompt": "12+34=", "completion": "46", "label": true}
                                      {"prompt": "12+34=", "completion": "45", "label": false}

Splits. The 10,000 problems are shuffled once with random.Random(seed); the first --eval-problems
form the held-out pool and never appear in a *_train file. sft_eval and pref_eval use the first
--eval-lines held-out problems; kto_eval uses the next --eval-lines / 2 problems, each once with
its right answer (label true) and once with a wrong one (label false). The training files draw
from the remaining problems: sft_train --sft-lines problems, pref_train --pref-lines, and kto_train
--kto-lines / 2 problems, each with a right and a wrong line, then shuffled.

Wrong answers are plausible mistakes, one picked at random among those that differ from the
right answer and are >= 0: off by one, off by ten, the digit-wise sum without carries, a forgotten
or an invented carry into the hundreds, or the answer's last two digits swapped.

Deterministic: the same --seed and sizes give byte-identical files (Python 3 standard library
only; dicts keep insertion order and random.Random's algorithms are fixed). Run from anywhere:

    python3 apps/data/make_data.py            # rewrites the files next to this script
    python3 apps/data/make_data.py --out DIR --seed 7 --sft-lines 4000
"""

import argparse
import json
import os
import random


def wrong_answers(a, b):
    """Plausible wrong answers for a + b (distinct, non-negative, not the right answer)."""
    s = a + b
    no_carry = (a // 10 + b // 10) % 10 * 10 + (a % 10 + b % 10) % 10
    candidates = [s - 1, s + 1, s - 10, s + 10, no_carry]
    if s >= 100:
        candidates.append(s - 100)  # forgot the carry into the hundreds
    else:
        candidates.append(s + 100)  # invented one
    if s >= 10:
        text = str(s)
        candidates.append(int(text[:-2] + text[-1] + text[-2]))  # swapped last two digits
    out = []
    for c in candidates:
        if c >= 0 and c != s and c not in out:
            out.append(c)
    return out


def prompt_of(a, b):
    return f"{a}+{b}="


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=True) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-problems", type=int, default=400)
    ap.add_argument("--eval-lines", type=int, default=200)
    ap.add_argument("--sft-lines", type=int, default=2000)
    ap.add_argument("--pref-lines", type=int, default=1500)
    ap.add_argument("--kto-lines", type=int, default=2000)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    problems = [(a, b) for a in range(100) for b in range(100)]
    rng.shuffle(problems)
    held_out = problems[: args.eval_problems]
    train = problems[args.eval_problems :]
    half_eval = args.eval_lines // 2
    if args.eval_lines + half_eval > len(held_out):
        raise SystemExit("--eval-problems too small for --eval-lines")
    if max(args.sft_lines, args.pref_lines, args.kto_lines // 2) > len(train):
        raise SystemExit("not enough training problems for the requested sizes")

    def sft(ps):
        return [{"prompt": prompt_of(a, b), "completion": str(a + b)} for a, b in ps]

    def pref(ps):
        return [
            {"prompt": prompt_of(a, b), "chosen": str(a + b),
             "rejected": str(rng.choice(wrong_answers(a, b)))}
            for a, b in ps
        ]

    def kto(ps):
        rows = []
        for a, b in ps:
            rows.append({"prompt": prompt_of(a, b), "completion": str(a + b), "label": True})
            rows.append({"prompt": prompt_of(a, b),
                         "completion": str(rng.choice(wrong_answers(a, b))), "label": False})
        rng.shuffle(rows)
        return rows

    os.makedirs(args.out, exist_ok=True)
    eval_ps = held_out[: args.eval_lines]
    kto_eval_ps = held_out[args.eval_lines : args.eval_lines + half_eval]
    files = {
        "sft_train.jsonl": sft(rng.sample(train, args.sft_lines)),
        "sft_eval.jsonl": sft(eval_ps),
        "pref_train.jsonl": pref(rng.sample(train, args.pref_lines)),
        "pref_eval.jsonl": pref(eval_ps),
        "kto_train.jsonl": kto(rng.sample(train, args.kto_lines // 2)),
        "kto_eval.jsonl": kto(kto_eval_ps),
    }
    for name, rows in files.items():
        write_jsonl(os.path.join(args.out, name), rows)
        print(f"{name}: {len(rows)} lines")


if __name__ == "__main__":
    main()
