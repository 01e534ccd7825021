#!/usr/bin/env python3
"""Error handling of chunkloss-train, chunkloss-eval and chunkloss-bench (ctest label cpu): bad
input makes an app print one line naming the problem and exit non-zero (2 for a bad command line,
1 for a runtime failure), and a failure never loses or corrupts an earlier output.

    cli_errors.py TRAIN EVAL BENCH WORKDIR CASE

CASE is one of:
  config: --config naming a symlink loop or a name too long, or a config file with a line
    `config = FILE` (one cannot include another), a NUL byte (named by its line) or more than
    1 MiB (/dev/zero), is a usage error (train and eval); a UTF-8 byte order mark is skipped.
  checkpoint_paths: a checkpoint directory option (train's --resume and --init, eval's --model
    and --reference) naming a symlink loop or a file is a usage error naming the option and the
    path; a data file option (train's --train-file, eval's --sft-file and --pref-file) naming a
    symlink loop, a missing file or a directory too. A resumed DPO run whose recorded --init became a loop names --resume and
    that checkpoint; eval refuses a later --model with cut-short weights before any pass.
  resume_state: --resume from an optimizer state with a negative second moment is refused,
    naming the file and the tensor; one whose finite moments blow a parameter up to Inf stops
    at that step naming it; neither writes a checkpoint.
  stdin: --train-file /dev/stdin (a pipe, readable once) trains, and its digest is the file's:
    a resume from the same bytes in a regular file is accepted.
  metrics: the metrics file is replaced atomically: a run that fails before its first checkpoint
    leaves the previous SAVE/metrics.jsonl as it was, one that fails later leaves it at its last
    checkpoint; the records so far are in SAVE/metrics.jsonl.partial meanwhile; a resume keeps
    the records up to its step and appends.
  outputs: output paths are checked before any work, naming the option: a directory or a
    device given as a file (eval --json, bench --json, train --chart, --metrics), a parent that is
    a file, an output that is an input (--train-file, --config, the --init checkpoint saved
    over, the metrics drawn as the chart) or a file of a checkpoint read or written (--resume's,
    --save's checkpoint-N) or of any directory holding a checkpoint's weights (bench --json
    too); a --save that is, holds or lies inside the --init checkpoint (a
    resumed run's recorded one too), and a --config or --train-file that is a file of --save;
    the inputs stay intact.
  messages: runtime errors name what to fix: too few examples for a micro-batch with
    --data-parallel names the file and both options; a checkpoint whose vocab_size is below the
    tokenizer's, or whose config.json's bos_token_id or eos_token_id is not the tokenizer's, is
    refused when loaded (--init, --model), naming it; a too long example is named
    by its line, as JSON errors are (blank lines count), and by the checkpoint's option, in train
    and eval; eval names a model whose held-out loss is not finite, or a reference whose
    log-probs are not (and counts a generated id that is no byte, from a model of vocab_size
    300, as a miss of exact match); threads that cannot start (limited address space) are
    refused before any work by train (ranks included), eval and bench, naming --threads, how many
    started and the stack sizes (OpenMP's threads take OMP_STACKSIZE's or GOMP_STACKSIZE's, read
    as libgomp reads it, the ranks' the system's), where libgomp would have ended the process with
    its own line; a tensor name holding control characters is printed with
    them escaped (ESC as \\x1b); a value out of range is shown as given (0.99999999999, not 1).
    Each is refused before any output: its error line is all the app prints. On a terminal (a
    pty), an error during the run starts its own line after the progress line. A loss that is
    not finite at a run's first step (no update yet) names the --init checkpoint, not --lr; eval's
    table escapes a label's line break and '|'.
  before_work: chunkloss-train refuses a training file with bad JSON, one missing the loss's
    field, an empty one, a KTO file of one example, and a metrics file whose FILE.partial is a
    directory before any work: its error line alone, not after the model summary. A
    --save-every save that fails (files limited to 4 KiB, as a full disk would) leaves no empty
    checkpoint-N directory.
  file_hazards: an empty path given for a path option (`--resume "$DIR"` with DIR unset) is a
    usage error, not "not given", and the checkpoint it would have replaced stays; an output's
    FILE.tmp or FILE.partial that is a directory or a symlink is refused before any work (the
    symlink's target untouched); a device as training data (/dev/zero) is refused, not read
    until memory runs out; a --save directory another process holds (flock) is refused; an
    error quoting 100 KB from a file, or 2000 bytes of invalid UTF-8 from the command line,
    prints a cut line; a trainer_state.json without the
    options every save records cannot be resumed.
  loss_options: chunkloss-train refuses at option parsing (exit 2, one line naming the option
    and the loss) an option the --loss does not take, a --label-smoothing outside the loss's
    range, --init with --resume, and --chart with nothing to draw it from.
  stdout: eval's table, bench's report and --help written to a full device (/dev/full) exit 1
    with one line saying that standard output could not be written.
  utf8: an option value (the command line's or the --config file's) that is not valid UTF-8,
    which the checkpoint's trainer_state.json or eval's and bench's --json could not record, is
    a usage error naming the option, before any work (all three apps); so is a --train-file whose
    absolute path (as the checkpoint records it) is not.
  names: each app takes an option only by its full name (a prefix such as train's --step for
    --steps is an unrecognised option) and refuses a word that is no option's value, naming it.
  bench_options: chunkloss-bench refuses at option parsing (exit 2, one line naming the option)
    --pairs x --seq-len whose N = 2 P T overflows, a shape with a buffer of more than 2^40
    values (whose byte count could wrap), a negative --seed, bf16 logits and --phases on
    the CPU, a --label-smoothing the loss (or DPO loss type) does not take, and --dpo-loss-type
    (chunkloss-train's name) for a loss other than dpo.
"""
import fcntl
import json
import os
import pty
import resource
import shutil
import signal
import struct
import subprocess
import sys

TINY = ["--hidden-size", "8", "--intermediate-size", "8", "--layers", "1", "--heads", "1",
        "--kv-heads", "1", "--batch-size", "2", "--threads", "1"]


SKIP = 77  # ctest's SKIP_RETURN_CODE for this script: a case that cannot run here


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def run(cmd, expect=0, **kw):
    if "stdout" in kw:
        kw["stderr"] = subprocess.PIPE
    else:
        kw["capture_output"] = True
    p = subprocess.run(cmd, text=True, **kw)
    if p.returncode != expect:
        fail("%s exited %d (expected %d)\nstdout:\n%s\nstderr:\n%s" %
             (" ".join(cmd), p.returncode, expect, p.stdout, p.stderr))
    return p


def one_line(cmd, expect, *words, alone=False, **kw):
    """Runs cmd, which must exit with `expect` and print one stderr line holding every word. A
    usage error (expect 2) must be the only line on stderr; with `alone` (a run refused before
    its work) the only output at all: no model summary or progress line before it."""
    p = run(cmd, expect, **kw)
    lines = p.stderr.strip().splitlines()
    errors = [l for l in lines if ": error: " in l or "see --help" in l]
    if len(errors) != 1 or any(w not in errors[0] for w in words):
        fail("%s: expected one line naming %s, got:\n%s" % (" ".join(cmd), words, p.stderr))
    if expect == 2 and len(lines) != 1:
        fail("%s: a usage error must be the only line, got:\n%s" % (" ".join(cmd), p.stderr))
    if alone and (len(lines) != 1 or p.stdout):
        fail("%s: a run refused before its work must print its error alone, got:\n%s%s" %
             (" ".join(cmd), p.stdout, p.stderr))
    return p


def set_tensor(path, name, value):
    """Overwrites every value of tensor `name` of the F32 safetensors file at `path` in place."""
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        begin, end = json.loads(f.read(n))[name]["data_offsets"]
        f.seek(8 + n + begin)
        f.write(struct.pack("<%df" % ((end - begin) // 4), *[value] * ((end - begin) // 4)))


def resume_state_case(train, work):
    a = os.path.join(work, "a")
    run([train, "--steps", "3", "--warmup-steps", "0", "--save", a, "--save-every", "2"] + TINY)
    for tensor, value, words in (
            ("model.norm.weight.exp_avg_sq", -1.0,
             ("optimizer.safetensors", "model.norm.weight.exp_avg_sq holds -1")),
            ("model.norm.weight.exp_avg", 3e38, ("step 3", "model.norm.weight", "inf"))):
        ck = os.path.join(work, "ck")
        shutil.rmtree(ck, ignore_errors=True)
        shutil.copytree(os.path.join(a, "checkpoint-2"), ck)
        set_tensor(os.path.join(ck, "optimizer.safetensors"), tensor, value)
        out = os.path.join(work, "out")
        shutil.rmtree(out, ignore_errors=True)
        one_line([train, "--steps", "3", "--warmup-steps", "0", "--resume", ck, "--save", out] +
                 TINY, 1, *words)
        if os.path.exists(os.path.join(out, "model.safetensors")):
            fail("a resume from a bad optimizer state (%s = %g) saved a checkpoint" %
                 (tensor, value))
    # A cross-entropy run over several micro-batches a step saved by a build that weighed them
    # equally (no grad_accum_weights in its state) cannot be continued exactly.
    g = os.path.join(work, "ga")
    shutil.rmtree(g, ignore_errors=True)
    ga = ["--steps", "3", "--warmup-steps", "0", "--grad-accum", "2"] + TINY
    run([train, "--save", g, "--save-every", "2"] + ga)
    ck = os.path.join(work, "ga-old")
    shutil.rmtree(ck, ignore_errors=True)
    shutil.copytree(os.path.join(g, "checkpoint-2"), ck)
    with open(os.path.join(ck, "trainer_state.json")) as f:
        state = json.load(f)
    if state["strings"].pop("grad_accum_weights") != "valid_targets":
        fail("a ce run with --grad-accum 2 must save grad_accum_weights valid_targets")
    with open(os.path.join(ck, "trainer_state.json"), "w") as f:
        json.dump(state, f)
    one_line([train, "--resume", ck] + ga, 1, "grad_accum_weights = equal",
             "this one has valid_targets", alone=True)


def stdin_case(train, work):
    data = "".join(json.dumps({"prompt": "%d+1=" % i, "completion": str(i + 1)}) + "\n"
                   for i in range(6))
    a = os.path.join(work, "a")
    p = run([train, "--train-file", "/dev/stdin", "--steps", "4", "--warmup-steps", "0",
             "--save", a, "--save-every", "2"] + TINY, input=data)
    if "6 examples" not in p.stderr:
        fail("--train-file /dev/stdin did not read the 6 examples:\n" + p.stderr)
    same = os.path.join(work, "same.jsonl")
    with open(same, "w") as f:
        f.write(data)
    run([train, "--train-file", same, "--steps", "4", "--warmup-steps", "0", "--resume",
         os.path.join(a, "checkpoint-2"), "--save", os.path.join(work, "b")] + TINY)


def names_case(train, evaluate, bench, work):
    ck = os.path.join(work, "ck")
    t = [train, "--warmup-steps", "0", "--save", ck] + TINY
    b = [bench, "--threads", "1", "--hidden", "16", "--vocab", "64", "--rows", "64"]
    for cmd, word in ((t + ["--step", "1"], "'--step'"),
                      ([evaluate, "--model", ck, "--limi", "2"], "'--limi'"),
                      (b + ["--repeat", "1"], "'--repeat'"),
                      (t + ["--steps", "1", "extra"], "'extra' is neither an option"),
                      ([evaluate, "--model", ck, "--limit", "2", "3"], "'3' is neither an option"),
                      (b + ["--repeats", "1", "--exact", "true"], "'true' is neither an option")):
        one_line(cmd, 2, word, alone=True)
    if os.path.exists(ck):
        fail("a refused command line wrote " + ck)
    # The full names run.
    run(t + ["--steps", "1"])
    run([evaluate, "--model", ck, "--limit", "2"])
    run(b + ["--repeats", "1", "--exact"])


def bench_options_case(bench):
    b = [bench, "--threads", "1", "--repeats", "1", "--hidden", "16", "--vocab", "64"]
    for extra, words in (
            (["--loss", "dpo", "--pairs", "2147483648", "--seq-len", "2147483648"],
             ("--pairs 2147483648 --seq-len 2147483648", "exceeds 2^31")),
            (["--loss", "dpo", "--pairs", "2", "--seq-len", "1073741824"], ("exceeds 2^31",)),
            (["--rows", "64", "--seed", "-1"], ("--seed", "-1")),
            (["--rows", "64", "--logits-dtype", "bf16"], ("--logits-dtype bf16", "--device cuda")),
            (["--loss", "simpo", "--pairs", "1", "--seq-len", "8", "--label-smoothing", "0.7"],
             ("--label-smoothing 0.7", "simpo", "[0, 0.5]")),
            (["--loss", "dpo", "--pairs", "1", "--seq-len", "8", "--label-smoothing", "1"],
             ("--label-smoothing 1", "dpo")),
            (["--loss", "orpo", "--pairs", "1", "--seq-len", "8", "--label-smoothing", "0.3"],
             ("--label-smoothing 0.3", "orpo", "no label smoothing")),
            (["--loss", "dpo", "--dpo-loss-type", "ipo", "--pairs", "1", "--seq-len", "8",
              "--label-smoothing", "0.3"], ("--label-smoothing 0.3", "--dpo-loss-type ipo")),
            (["--loss", "dpo", "--dpo-loss-type", "exo_pair", "--pairs", "1", "--seq-len", "8"],
             ("--label-smoothing 0", "exo_pair")),
            (["--loss", "simpo", "--dpo-loss-type", "ipo", "--pairs", "1", "--seq-len", "8"],
             ("--dpo-loss-type is for --loss dpo",)),
            (["--loss", "dpo", "--pairs", "1", "--seq-len", "8", "--phases"],
             ("--phases", "--device cuda")),
            (["--rows", "64", "--token-objective", "focal"], ("--token-objective", "focal")),
            (["--loss", "dpo", "--pairs", "1", "--seq-len", "8", "--token-objective", "nll"],
             ("--token-objective is for --loss ce",))):
        one_line(b + extra, 2, *words)
    # The token objective's case runs, checked against the naive, and its command names it.
    p = run(b + ["--rows", "64", "--token-objective", "nll"])
    if p.returncode != 0 or "--token-objective nll" not in p.stdout or "ce (token nll)" not in p.stdout:
        fail("the token objective's case must run and its command name --token-objective:\n" +
             p.stdout + p.stderr)
    one_line([bench, "--rows", "2147483648", "--hidden", "2147483648", "--no-naive"], 2,
             "--rows 2147483648 --hidden 2147483648", "more than 2^40")
    # A value the loss takes runs, under chunkloss-train's option name, which the case's
    # reproducing command uses too.
    p = run(b + ["--loss", "dpo", "--dpo-loss-type", "exo_pair", "--label-smoothing", "0.1",
                 "--pairs", "1", "--seq-len", "8"])
    if "--regime auto --dpo-loss-type exo_pair" not in p.stdout:
        fail("the case's command must name --dpo-loss-type:\n" + p.stdout)
    # --device cuda with no device visible: the refusal alone, before the header line (a bench
    # built without CUDA refuses the device as a usage error).
    hidden = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    cuda = b + ["--device", "cuda", "--rows", "64"]
    if "cuda" in run([bench, "--help"]).stdout.split("--device arg")[1].split("\n")[0]:
        one_line(cuda, 1, "needs 1 CUDA device(s), 0 visible", alone=True, env=hidden)
        one_line(cuda + ["--vocab-parallel", "2"], 1, "--vocab-parallel 2 needs 2", alone=True,
                 env=hidden)
    else:
        one_line(cuda, 2, "--device", "not built into this bench", env=hidden)


def steps_of(path):
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def log_history_steps(checkpoint):
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        return [r["step"] for r in json.load(f)["log_history"]]


def metrics_case(train, work):
    d = os.path.join(work, "d")
    m = os.path.join(d, "metrics.jsonl")
    base = [train, "--warmup-steps", "0", "--save", d] + TINY
    run(base + ["--steps", "3"])
    with open(m) as f:
        first = f.read()
    # A checkpoint directory a save could not write (a file in its place) fails the run before
    # its first step.
    blocker = os.path.join(d, "checkpoint-2")
    with open(blocker, "w") as f:
        f.write("not a directory")
    one_line(base + ["--steps", "4", "--save-every", "2"], 1, "checkpoint-2", alone=True)
    os.remove(blocker)
    with open(m) as f:
        if f.read() != first or os.path.exists(m + ".partial"):
            fail("a run refused before its first step changed " + m + " or wrote its .partial")
    # Run A: each checkpoint holds the records up to its step.
    run(base + ["--steps", "6", "--save-every", "2"])
    if steps_of(m) != [1, 2, 3, 4, 5, 6] or os.path.exists(m + ".partial"):
        fail("a finished run must leave steps 1-6 in %s and no .partial" % m)
    with open(m) as f:
        a_records = f.read().splitlines()
    for n in (2, 4):
        if log_history_steps(os.path.join(d, "checkpoint-%d" % n)) != list(range(1, n + 1)):
            fail("checkpoint-%d must hold the records of steps 1-%d" % (n, n))
    # Run B, new, into the same directory: --lr 10 with weight decay multiplies the weights by
    # -9 a step, so it diverges within a few steps (the step depends on the CPU's rounding),
    # after its checkpoint-3 if it gets there. The metrics file stays A's (as SAVE's checkpoint
    # does), B's records are in the .partial, and A's checkpoint-4 is untouched.
    p = one_line(base + ["--steps", "40", "--save-every", "3", "--lr", "10", "--weight-decay",
                         "1"], 1, "step ")
    if "not finite" not in p.stderr and "made parameter" not in p.stderr:
        fail("run B must stop on its non-finite loss or parameters, got:\n" + p.stderr)
    if "warning: --save %s holds checkpoint-2, checkpoint-4 of an earlier run" % d not in p.stderr:
        fail("run B must warn of A's checkpoints it leaves, got:\n" + p.stderr)
    with open(m) as f:
        if f.read().splitlines() != a_records:
            fail("a run that failed changed " + m)
    b_steps = steps_of(m + ".partial")
    if not b_steps or b_steps != list(range(1, len(b_steps) + 1)):
        fail("the failed run's records must be in metrics.jsonl.partial, got %s" % b_steps)
    # A resume of A from its checkpoint-4 into the same directory: A's steps 1-4 (not B's),
    # then 5-6 again.
    run(base[:1] + ["--warmup-steps", "0", "--save", d, "--steps", "6", "--resume",
                    os.path.join(d, "checkpoint-4"), "--batch-size", "2", "--threads", "1"])
    with open(m) as f:
        got = f.read().splitlines()
    if steps_of(m) != [1, 2, 3, 4, 5, 6] or got[:4] != a_records[:4]:
        fail("a resume from step 4 must keep A's records of steps 1-4, got steps %s" % steps_of(m))


def outputs_case(train, evaluate, bench, work):
    ck = os.path.join(work, "ck")
    run([train, "--steps", "2", "--warmup-steps", "0", "--save", ck, "--save-every", "1"] + TINY)
    afile = os.path.join(work, "afile")
    data = os.path.join(work, "x.jsonl")
    ini = os.path.join(work, "c.ini")
    for path, text in ((afile, "x"), (data, '{"prompt": "1+1=", "completion": "2"}\n' * 4),
                       (ini, "steps = 2\n")):
        with open(path, "w") as f:
            f.write(text)
    m = os.path.join(work, "m.jsonl")
    t = [train, "--steps", "2", "--warmup-steps", "0"] + TINY
    e = [evaluate, "--model", ck, "--limit", "2"]
    b = [bench, "--threads", "1", "--repeats", "1", "--hidden", "16", "--vocab", "64", "--rows",
         "64"]
    state = os.path.join(ck, "trainer_state.json")
    with open(state) as f:
        saved_state = f.read()
    for cmd, code, words in (
            (e + ["--json", work], 2, ("--json", "is a directory")),
            (e + ["--json", "/dev/null"], 2, ("--json", "not a regular file")),
            (e + ["--json", os.path.join(ck, "config.json")], 2, ("--json", "checkpoint")),
            (e + ["--json", os.path.join(afile, "x.json")], 1, ("--json", "afile")),
            (b + ["--json", work], 2, ("--json", "is a directory")),
            (b + ["--json", os.path.join(ck, "checkpoint-1", "config.json")], 2,
             ("--json", "holds model.safetensors")),
            (t + ["--metrics", m, "--chart", work], 2, ("--chart", "is a directory")),
            (t + ["--metrics", os.path.join(afile, "m.jsonl")], 1,
             ("--metrics", "cannot create directory", "afile")),
            (t + ["--train-file", data, "--metrics", data], 2, ("--metrics", "input")),
            (t + ["--config", ini, "--metrics", ini], 2, ("--metrics", "input")),
            (t + ["--metrics", m, "--chart", m], 2, ("--chart", "input")),
            (t + ["--resume", os.path.join(ck, "checkpoint-1"), "--metrics",
                  os.path.join(ck, "checkpoint-1", "trainer_state.json")], 2,
             ("--metrics", "checkpoint")),
            (t + ["--metrics", state], 2, ("--metrics", "checkpoint")),  # (--init's, below)
            # A checkpoint the run does not use.
            (t + ["--metrics", os.path.join(ck, "config.json")], 2,
             ("--metrics", "checkpoint in " + ck, "holds model.safetensors")),
            ([evaluate, "--model", os.path.join(ck, "checkpoint-1"), "--limit", "2", "--json",
              os.path.join(ck, "optimizer.safetensors")], 2,
             ("--json", "holds model.safetensors")),
            (t + ["--save", work, "--metrics", os.path.join(work, "checkpoint-1",
                                                             "model.safetensors")], 2,
             ("--metrics", "checkpoint-1")),
            (t + ["--init", ck, "--save", ck], 2, ("--save", "--init"))):
        if cmd[-1] == state:
            cmd = cmd[:-2] + ["--init", ck, "--metrics", state]
        p = one_line(cmd, code, *words)
        if "step" in p.stderr or "case 1" in p.stderr or "|" in p.stdout:
            fail("%s: refused only after some work:\n%s%s" % (" ".join(cmd), p.stdout, p.stderr))
    with open(data) as f:
        if f.read() != '{"prompt": "1+1=", "completion": "2"}\n' * 4:
            fail("--metrics overwrote the training data")
    with open(state) as f:
        if f.read() != saved_state:
            fail("--metrics overwrote the checkpoint's trainer_state.json")
    # The saves (SAVE, SAVE/checkpoint-N) stay apart from the checkpoint the run starts from:
    # --init's, or the one a resumed run records (DPO's reference); an input is no file of SAVE.
    dpo = os.path.join(work, "dpo")
    run(t + ["--loss", "dpo", "--init", ck, "--save", dpo, "--save-every", "1"])
    cs = os.path.join(work, "cs")
    os.makedirs(cs)
    ini_in_save = os.path.join(cs, "config.json")
    data_in_save = os.path.join(cs, "trainer_state.json")
    for path, text in ((ini_in_save, "steps = 2\n"),
                       (data_in_save, '{"prompt": "1+1=", "completion": "2"}\n' * 4)):
        with open(path, "w") as f:
            f.write(text)
    first = os.path.join(ck, "checkpoint-1")
    before = tree(ck), tree(cs)
    for cmd, words in (
            (t + ["--init", first, "--save", ck, "--save-every", "1"],
             ("--save " + ck, "holds the --init checkpoint " + first)),
            (t + ["--init", ck, "--save", os.path.join(first, "x")], ("lies inside", "--init")),
            (t + ["--loss", "dpo", "--resume", os.path.join(dpo, "checkpoint-1"), "--save", ck],
             ("--save " + ck, "is the --init checkpoint", "--resume")),
            (t + ["--config", ini_in_save, "--save", cs], ("--config " + ini_in_save,)),
            (t + ["--train-file", data_in_save, "--save", cs], ("--train-file " + data_in_save,))):
        one_line(cmd, 2, *words)
    if (tree(ck), tree(cs)) != before:
        fail("a refused --save changed the --init checkpoint or an input in SAVE")
    run(t + ["--resume", os.path.join(ck, "checkpoint-1")])


def tree(top):
    """Every file under `top`: relative path -> bytes."""
    out = {}
    for d, _, files in os.walk(top):
        for name in files:
            with open(os.path.join(d, name), "rb") as f:
                out[os.path.relpath(os.path.join(d, name), top)] = f.read()
    return out


def read_model(ck):
    """Checkpoint `ck`'s model.safetensors: its header and its tensors' bytes."""
    with open(os.path.join(ck, "model.safetensors"), "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def rewrite(ck, header, blobs, config_set, config_drop=()):
    """Writes checkpoint `ck`'s model.safetensors from `header` and the tensors' bytes `blobs`;
    in its config.json sets the keys of dict `config_set` and removes those of `config_drop`."""
    head = json.dumps(header).encode()
    with open(os.path.join(ck, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + blobs)
    with open(os.path.join(ck, "config.json")) as f:
        config = json.load(f)
    config.update(config_set)
    for key in config_drop:
        del config[key]
    with open(os.path.join(ck, "config.json"), "w") as f:
        json.dump(config, f)


def shrink_vocab(ck, vocab):
    """Rewrites checkpoint `ck` as a model of `vocab` tokens (fewer rows of the embedding and
    lm_head), as a checkpoint made for another tokenizer would be."""
    header, data = read_model(ck)
    out, blobs = {}, b""
    for name, t in header.items():
        if name == "__metadata__":
            out[name] = t
            continue
        blob = data[t["data_offsets"][0]:t["data_offsets"][1]]
        if t["shape"][0] > vocab and len(t["shape"]) == 2:
            blob = blob[:vocab * t["shape"][1] * 4]
            t = dict(t, shape=[vocab, t["shape"][1]])
        out[name] = dict(t, data_offsets=[len(blobs), len(blobs) + len(blob)])
        blobs += blob
    # (no pad token, as Llama's own configs have it)
    rewrite(ck, out, blobs, {"vocab_size": vocab, "pad_token_id": None})


def emitting_model(ck, vocab, emit):
    """Rewrites checkpoint `ck` as a model of `vocab` tokens whose greedy decoding emits `emit`,
    then EOS (257): zero projections and unit norms, so the final hidden state is the token's
    embedding, which is e0 for every token but `emit` (e1); the lm_head maps e0 to `emit` and
    e1 to EOS."""
    header, _ = read_model(ck)
    hidden = header["model.embed_tokens.weight"]["shape"][1]
    out, blobs = {}, b""
    for name, t in sorted((k, v) for k, v in header.items() if k != "__metadata__"):
        shape = [vocab, hidden] if name in ("model.embed_tokens.weight", "lm_head.weight") \
            else t["shape"]
        values = [1.0 if len(shape) == 1 else 0.0] * (shape[0] * (shape[1:] or [1])[0])
        if name == "model.embed_tokens.weight":
            for token in range(vocab):
                values[token * hidden + (1 if token == emit else 0)] = 1.0
        if name == "lm_head.weight":
            values[emit * hidden] = values[257 * hidden + 1] = 10.0
        blob = struct.pack("<%df" % len(values), *values)
        out[name] = {"dtype": "F32", "shape": shape,
                     "data_offsets": [len(blobs), len(blobs) + len(blob)]}
        blobs += blob
    rewrite(ck, out, blobs, {"vocab_size": vocab}, ["chunkloss_save_id"])


def messages_case(train, evaluate, bench, work):
    one = os.path.join(work, "one.jsonl")
    with open(one, "w") as f:
        f.write(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    one_line([train, "--train-file", one, "--steps", "2", "--data-parallel", "2"] + TINY, 1,
             one, "1 example", "--batch-size 2", "--data-parallel 2", alone=True)

    good = os.path.join(work, "good")
    run([train, "--steps", "1", "--warmup-steps", "0", "--save", good] + TINY)

    # Threads the system cannot start fail the run before its work, naming the options, where
    # libgomp would end the process with its own line: with thread stacks of 1 GiB in 32 GiB of
    # address space, about 30 threads start. (A sanitizer's shadow memory needs more address space
    # than that, so a sanitized app cannot be checked so.) The stack size variables of the
    # environment the test runs in are left out.
    def few_threads():
        resource.setrlimit(resource.RLIMIT_STACK, (1 << 30, 1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (32 << 30, 32 << 30))

    def no_more_space():
        resource.setrlimit(resource.RLIMIT_AS, (32 << 30, 32 << 30))
    plain = {k: v for k, v in os.environ.items() if k not in ("OMP_STACKSIZE", "GOMP_STACKSIZE")}
    with open(train, "rb") as f:
        sanitized = any(s in f.read() for s in (b"__asan_init", b"__tsan_init"))
    if sanitized:
        print("messages: threads that cannot start are not checked: %s is built with a "
              "sanitizer" % train)
    else:
        tiny = TINY[:]
        del tiny[tiny.index("--batch-size"):tiny.index("--batch-size") + 2]
        tiny = tiny[:tiny.index("--threads")]
        b = [bench, "--rows", "64", "--hidden", "16", "--vocab", "64", "--repeats", "1"]
        needs = ": the run needs %d threads besides the main thread, and the system started only"
        for cmd, env, words in (
                ([train, "--data-parallel", "256", "--batch-size", "256", "--steps", "1",
                  "--threads", "1"] + tiny, {},
                 ["--threads 1 with --data-parallel 256" + needs % 256,
                  "stacks of 1024 MiB each, the system's default"]),
                ([train, "--steps", "1", "--threads", "64"] + tiny, {},
                 ["--threads 64" + needs % 63, "stacks of 1024 MiB each, the system's default"]),
                ([evaluate, "--model", good, "--limit", "2", "--threads", "64"], {},
                 ["--threads 64" + needs % 63, "stacks of 1024 MiB each, the system's default"]),
                (b + ["--threads", "64"], {},
                 ["--threads 64" + needs % 63, "stacks of 1024 MiB each, the system's default"]),
                (b + ["--threads", "64"], {"OMP_STACKSIZE": "2g"},
                 ["stacks of 2048 MiB each, from OMP_STACKSIZE"]),
                (b + ["--threads", "64"], {"GOMP_STACKSIZE": " 2048 M "},
                 ["stacks of 2048 MiB each, from GOMP_STACKSIZE"]),
                # The ranks' threads keep the system's stacks, their teams take OpenMP's.
                ([train, "--data-parallel", "32", "--batch-size", "32", "--steps", "1",
                  "--threads", "64"] + tiny, {"OMP_STACKSIZE": "8M"},
                 ["--threads 64 with --data-parallel 32" + needs % 64,
                  "stacks of 1024 MiB for 32 of them, the system's default, and 8 MiB for the "
                  "other 32, OpenMP's, from OMP_STACKSIZE"])):
            one_line(cmd, 1, *words, alone=True, preexec_fn=few_threads, env=dict(plain, **env))
        # What OpenMP's threads would get passes: its stack size, read as libgomp reads it.
        for size in ("8M", "+8m", "8192", " 8 M "):
            run(b + ["--threads", "64"], preexec_fn=few_threads,
                env=dict(plain, OMP_STACKSIZE=size))
        run(b + ["--threads", "64"], preexec_fn=few_threads, env=dict(plain, GOMP_STACKSIZE="8m"))
        # Ranks with one thread each have no team: OpenMP's stack size does not count for them.
        run([train, "--data-parallel", "16", "--batch-size", "16", "--steps", "1",
             "--threads", "16"] + tiny, preexec_fn=no_more_space,
            env=dict(plain, OMP_STACKSIZE="4G"))

    ck = os.path.join(work, "v258")
    run([train, "--steps", "1", "--warmup-steps", "0", "--save", ck] + TINY)
    shrink_vocab(ck, 258)
    one_line([train, "--init", ck, "--steps", "2", "--batch-size", "2", "--threads", "1"], 1,
             "--init " + ck, "vocab_size 258", "259", alone=True)
    one_line([evaluate, "--model", ck, "--limit", "2"], 1, "--model " + ck, "vocab_size 258",
             alone=True)

    # An empty path would name the working directory (or no file at all).
    for cmd, option in (([evaluate, "--model", ""], "--model"),
                        ([evaluate, "--model", good, "--sft-file", ""], "--sft-file"),
                        ([evaluate, "--model", good, "--pref-file", ""], "--pref-file")):
        one_line(cmd, 2, option + ": the path is empty")
    # A checkpoint whose BOS or EOS is not the byte tokenizer's (made for another tokenizer, as
    # Llama's 1 and 2) is refused when loaded, naming its config.json and the field.
    for field, value, words in (("bos_token_id", 1, "bos_token_id 1, not the byte tokenizer's "
                                                    "BOS id 256"),
                                ("eos_token_id", [258, 257], "eos_token_id 258")):
        other = os.path.join(work, field)
        shutil.copytree(good, other)
        rewrite(other, *read_model(other), {field: value})
        for cmd, option in (([evaluate, "--model", other, "--limit", "2"], "--model"),
                            ([train, "--init", other, "--steps", "2"] + TINY, "--init")):
            one_line(cmd, 1, option + " " + other + ": its config.json has " + words, alone=True)
    # A file's names reach the error line with their control characters escaped: a tensor name
    # holding ESC, BEL, DEL and a line break cannot drive the terminal or break the line.
    hostile = os.path.join(work, "hostile")
    shutil.copytree(good, hostile)
    header, blobs = read_model(hostile)
    header["evil\x1b[31m\x07\x7f\n"] = {"dtype": "F32", "shape": [1],
                                       "data_offsets": [len(blobs), len(blobs) + 4]}
    rewrite(hostile, header, blobs + bytes(4), {})
    p = one_line([evaluate, "--model", hostile, "--limit", "2"], 1,
                 "unexpected tensor evil\\x1b[31m\\x07\\x7f\\x0a", alone=True)
    if any(c in p.stderr.rstrip("\n") for c in "\x1b\x07\x7f\n"):
        fail("a control character of a tensor name reached the terminal: %r" % p.stderr)
    # A model of 300 tokens that generates id 299, no byte of the tokenizer's: a miss of exact
    # match, not a failure.
    v300 = os.path.join(work, "v300")
    shutil.copytree(good, v300)
    emitting_model(v300, 300, 299)
    out = os.path.join(work, "v300.json")
    run([evaluate, "--model", v300, "--limit", "2", "--json", out])
    with open(out) as f:
        if json.load(f)[0]["exact_match"] != 0:
            fail("a generated id that is no byte must count as a miss")
    # Row labels holding a line break or '|' stay one table cell each: escaped, not breaking rows.
    p = run([evaluate, "--model", good, "--model", good, "--name", "a\nb", "--name", "x|y",
             "--limit", "2"])
    rows = [l for l in p.stdout.splitlines() if l.startswith("|")]
    if len(rows) != 4 or "| a\\x0ab " not in rows[2] or "| x\\|y " not in rows[3]:
        fail("eval's table must escape its labels, got:\n" + p.stdout)
    # Finite weights whose logits overflow: eval refuses the NaN loss rather than printing it
    # and writing null to --json.
    huge = os.path.join(work, "huge")
    shutil.copytree(good, huge)
    set_tensor(os.path.join(huge, "model.safetensors"), "lm_head.weight", 3e38)
    out = os.path.join(work, "huge.json")
    one_line([evaluate, "--model", huge, "--limit", "2", "--json", out], 1,
             "--model " + huge + ": its eval_loss", "not finite", alone=True)
    # The same as the reference: named as the reference, not as the model it measures.
    one_line([evaluate, "--model", good, "--reference", huge, "--limit", "2", "--json", out], 1,
             "--reference " + huge + ": its log-probs of the pair of", "not finite", alone=True)
    # Training from it fails at its first step, before any update: the checkpoint is named, not
    # --lr.
    one_line([train, "--init", huge, "--steps", "2", "--warmup-steps", "0", "--batch-size", "2",
              "--threads", "1"], 1, "step 1: the loss or the gradient norm is not finite",
             "no update has run yet, so the weights of --init " + huge + " give non-finite")
    if os.path.exists(out):
        fail("eval wrote --json for a model whose loss is not finite")
    for cmd, words in (([evaluate, "--model", good, "--batch-size", "-1"],
                        "--batch-size: -1 is not in [1, 1048576]"),
                       ([evaluate, "--model", good, "--beta", "1e6"], "--beta: 1e+06 is not in"),
                       ([train, "--beta2", "0.99999999999"], "--beta2: 0.99999999999 is not in")):
        one_line(cmd, 2, words, alone=True)

    long_file = os.path.join(work, "long.jsonl")
    with open(long_file, "w") as f:
        f.write(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n\n")
        f.write(json.dumps({"prompt": "1+1=", "completion": "2" * 80}) + "\n")
    for cmd, model in (([train, "--train-file", long_file, "--max-length", "0", "--steps", "2"] +
                        TINY, "the new model"),
                       ([evaluate, "--model", good, "--sft-file", long_file], "--model " + good)):
        one_line(cmd, 1, long_file + ":3: the example encodes to 85 positions",
                 "max_position_embeddings = 64 of " + model, alone=True)
    # On a terminal, an error during the run starts a line of its own, after the progress line.
    master, slave = pty.openpty()
    p = subprocess.Popen([train, "--steps", "40", "--max-grad-norm", "0", "--warmup-steps", "0",
                          "--lr", "10", "--hidden-size", "32", "--intermediate-size", "64",
                          "--threads", "1"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=slave)
    os.close(slave)
    tty = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # (EIO once the app has exited)
            break
        if not chunk:
            break
        tty += chunk
    os.close(master)
    lines = tty.decode(errors="replace").replace("\r", "\n").split("\n")
    if p.wait() != 1 or not any(l.startswith("chunkloss-train: error: step ") for l in lines):
        fail("on a terminal, the error must start its own line, got: %r" % tty[-300:])
    kto = os.path.join(work, "kto.jsonl")
    with open(kto, "w") as f:
        f.write(json.dumps({"prompt": "p" * 40, "completion": "a", "label": True}) + "\n\n")
        f.write(json.dumps({"prompt": "q", "completion": "b" * 40, "label": False}) + "\n")
    one_line([train, "--loss", "kto", "--train-file", kto, "--max-length", "0", "--steps", "2"] +
             TINY, 1, kto + ": the KL pair of line 1's prompt and line 3's completion", alone=True)


def loss_options_case(train, work):
    t = [train, "--steps", "2", "--warmup-steps", "0"] + TINY
    for extra, words in (
            (["--beta", "0.5"], ("--beta", "--loss ce")),
            (["--gamma", "3"], ("--gamma", "--loss ce", "simpo")),
            (["--dpo-loss-type", "hinge"], ("--dpo-loss-type", "--loss ce")),
            (["--loss", "orpo", "--rpo-alpha", "1"], ("--rpo-alpha", "--loss orpo")),
            (["--loss", "orpo", "--label-smoothing", "0.3"], ("--label-smoothing", "orpo")),
            (["--loss", "kto", "--label-smoothing", "0.3"], ("--label-smoothing", "kto")),
            (["--loss", "dpo", "--skip-ignored-rows", "0"], ("--skip-ignored-rows", "dpo")),
            (["--loss", "cpo", "--simpo-alpha", "1"], ("--simpo-alpha", "cpo")),
            (["--loss", "simpo", "--label-smoothing", "0.7"], ("--label-smoothing 0.7", "simpo")),
            (["--loss", "dpo", "--label-smoothing", "1"], ("--label-smoothing 1", "dpo")),
            (["--loss", "dpo", "--dpo-loss-type", "ipo", "--label-smoothing", "0.2"],
             ("--label-smoothing 0.2", "ipo")),
            (["--loss", "dpo", "--dpo-loss-type", "exo_pair"], ("--label-smoothing 0", "exo_pair")),
            (["--loss", "dpo", "--z-loss", "0.01"], ("--z-loss", "--loss dpo")),
            (["--discopop-tau", "0.1"], ("--discopop-tau", "--loss ce")),
            (["--loss", "dpo", "--discopop-tau", "0.1"], ("--discopop-tau", "sigmoid", "discopop")),
            (["--loss", "dpo", "--dpo-loss-type", "discopop", "--discopop-tau", "0"],
             ("--loss dpo options", "discopop_tau must be finite and > 0")),
            (["--temperature", "0.5"], ("--temperature", "--loss ce", "grpo")),
            (["--loss", "dpo", "--num-generations", "4"], ("--num-generations", "--loss dpo")),
            (["--loss", "grpo", "--num-generations", "1"], ("--num-generations", "1")),
            (["--loss", "grpo", "--temperature", "0"], ("--temperature",)),
            (["--loss", "grpo", "--max-completion-length", "0"], ("--max-completion-length",)),
            (["--loss", "grpo", "--grpo-loss-type", "dapo"],
             ("--loss grpo options", "dapo", "dr_grpo")),
            (["--loss", "grpo", "--scale-rewards", "global"], ("--scale-rewards", "global")),
            (["--loss", "grpo", "--mask-truncated-completions", "2"],
             ("--mask-truncated-completions",)),
            (["--loss", "dpo", "--epsilon", "0.1"], ("--epsilon", "--loss dpo")),
            (["--loss", "grpo", "--importance-sampling-level", "seq"],
             ("--loss grpo options", "importance_sampling_level 'seq'")),
            (["--loss", "grpo", "--epsilon", "1"], ("--epsilon",)),
            (["--loss", "grpo", "--delta", "1.1"], ("--loss grpo options", "delta")),
            (["--loss", "grpo", "--num-iterations", "2", "--save", os.path.join(work, "it"),
              "--save-every", "3"], ("--save-every 3", "--num-iterations 2")),
            (["--init", "a", "--resume", "b"], ("--init a", "--resume b")),
            (["--chart", os.path.join(work, "c.svg")], ("--chart", "--metrics", "--save"))):
        one_line(t + extra, 2, *words)
    if os.path.exists(os.path.join(work, "c.svg")):
        fail("a refused --chart was written")
    # The same options where they belong run (label smoothing shared by ce, dpo, simpo, cpo).
    for extra in (["--label-smoothing", "0.1"],
                  ["--loss", "dpo", "--dpo-loss-type", "exo_pair", "--label-smoothing", "0.1"],
                  ["--loss", "dpo", "--dpo-loss-type", "discopop", "--discopop-tau", "0.1"],
                  ["--loss", "simpo", "--gamma", "1", "--label-smoothing", "0.5"],
                  ["--loss", "grpo", "--num-generations", "2", "--max-completion-length", "4",
                   "--grpo-loss-type", "bnpo", "--num-iterations",
                   "2", "--epsilon", "0.1", "--epsilon-high", "0.28", "--delta", "2",
                   "--importance-sampling-level", "sequence", "--scale-rewards", "batch",
                   "--mask-truncated-completions", "1"]):
        run(t + extra)
    # GRPO's data: a line without a prompt, and lengths that leave no answer room to be right,
    # are refused before any work; lengths that leave some answers none are warned of once.
    text = os.path.join(work, "text.jsonl")
    with open(text, "w") as f:
        f.write(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
        f.write(json.dumps({"text": "2+2=4"}) + "\n")
    g = t + ["--loss", "grpo", "--num-generations", "2"]
    one_line(g + ["--train-file", text], 1, "text.jsonl:2", "has none", alone=True)
    one_line(g + ["--max-length", "1"], 1, "no example's answer fits", "--max-length 1",
             alone=True)
    one_line(g + ["--max-completion-length", "1"], 1, "no example's answer fits",
             "--max-completion-length 1", alone=True)
    p = run(g + ["--max-completion-length", "2"])
    warn = [line for line in p.stderr.splitlines() if ": warning: " in line]
    if len(warn) != 1 or "can never score" not in warn[0] or "needs 4" not in warn[0]:
        fail("grpo --max-completion-length 2: expected one warning naming the answers that need "
             "more, got:\n" + p.stderr)
    run(g + ["--epsilon-high", "0"])  # (0: --epsilon's value, as --help says)
    # The z-loss is reported, and is part of the loss (the same run without it has a lower loss).
    losses = []
    for z in ("0", "0.5"):
        m = os.path.join(work, "z%s.jsonl" % z)
        run(t + ["--z-loss", z, "--metrics", m])
        with open(m) as f:
            first = json.loads(f.readline())
        if (z == "0") != ("z_loss" not in first) or (z != "0" and not first["z_loss"] > 0):
            fail("--z-loss %s: the metrics' z_loss, got %s" % (z, first))
        losses.append(first["loss"])
    if not losses[1] > losses[0]:
        fail("--z-loss 0.5 must add to the step's loss, got %s" % losses)


def stdout_case(train, evaluate, bench, work):
    ck = os.path.join(work, "ck")
    run([train, "--steps", "1", "--warmup-steps", "0", "--save", ck] + TINY)
    if not os.path.exists("/dev/full"):
        print("SKIP: no /dev/full to write the outputs into")
        sys.exit(SKIP)
    with open("/dev/full", "w") as full:
        for cmd in ([evaluate, "--model", ck, "--limit", "2"],
                    [bench, "--threads", "1", "--repeats", "1", "--hidden", "16", "--vocab", "64",
                     "--rows", "64"],
                    [train, "--help"], [evaluate, "--help"], [bench, "--help"]):
            one_line(cmd, 1, "standard output", stdout=full)


def config_case(train, evaluate, work):
    loop = os.path.join(work, "loop.ini")
    if os.path.lexists(loop):
        os.remove(loop)
    os.symlink(loop, loop)
    long_name = os.path.join(work, "a" * 300 + ".ini")
    # A config file naming another, which was ignored.
    inner, outer = os.path.join(work, "inner.ini"), os.path.join(work, "outer.ini")
    with open(inner, "w") as f:
        f.write("threads = 1\n")
    with open(outer, "w") as f:
        f.write("threads = 1\nconfig = " + inner + "\n")
    # A boolean option left empty (Boost's bool reads it as true) or misspelled is refused.
    empty = os.path.join(work, "empty-bool.ini")
    with open(empty, "w") as f:
        f.write("tie-embeddings =\n")
    one_line([train, "--config", empty], 2, "--tie-embeddings: '' is not a boolean", alone=True)
    for option in ("--tie-embeddings", "--skip-ignored-rows"):
        for value in ("", "maybe", "2"):
            one_line([train, option, value], 2, option + ": '" + value + "' is not a boolean",
                     alone=True)
    # A NUL byte (which would cut Boost's message short) names its line; a file that never ends
    # is refused at 1 MiB; a UTF-8 byte order mark is skipped.
    nul = os.path.join(work, "nul.ini")
    with open(nul, "wb") as f:
        f.write(b"threads = 1\n\0\1\2\n")
    zero = os.path.join(work, "zero.ini")
    if not os.path.lexists(zero):
        os.symlink("/dev/zero", zero)
    bom = os.path.join(work, "bom.ini")
    with open(bom, "wb") as f:
        f.write(b"\xef\xbb\xbfsteps = 1\nwarmup-steps = 0\n")
    run([train, "--config", bom] + TINY)
    for app in (train, evaluate):
        one_line([app, "--config", nul], 2, "--config " + nul + ": line 2 holds a NUL byte",
                 alone=True)
        one_line([app, "--config", zero], 2, "--config " + zero + ": more than 1 MiB", alone=True)
        one_line([app, "--config", loop], 2, "--config", loop)
        one_line([app, "--config", long_name], 2, "--config", "name too long")
        one_line([app, "--config", outer], 2, "--config " + outer + ": 'config = " + inner + "'",
                 "cannot include another", alone=True)


def checkpoint_paths_case(train, evaluate, work):
    loop = os.path.join(work, "loop")
    os.symlink(loop, loop)
    afile = os.path.join(work, "afile")
    with open(afile, "w") as f:
        f.write("x")
    ck = os.path.join(work, "ck")
    run([train, "--steps", "1", "--warmup-steps", "0", "--save", ck] + TINY)
    t = [train, "--steps", "2", "--warmup-steps", "0"] + TINY
    for path, problem in ((loop, "cannot open " + loop), (afile, afile + " is not a directory")):
        for cmd, option in ((t + ["--resume", path], "--resume"), (t + ["--init", path], "--init"),
                            ([evaluate, "--model", path], "--model"),
                            ([evaluate, "--model", ck, "--model", path], "--model"),
                            ([evaluate, "--model", ck, "--reference", path], "--reference")):
            one_line(cmd, 2, option + ": " + problem)
    # A resumed DPO run whose recorded --init (its reference) became a loop: named as such.
    sft, dpo = os.path.join(work, "sft"), os.path.join(work, "dpo")
    run([train, "--steps", "1", "--warmup-steps", "0", "--save", sft] + TINY)
    run([train, "--loss", "dpo", "--init", sft, "--steps", "1", "--warmup-steps", "0", "--save",
         dpo] + TINY)
    os.rename(sft, sft + ".moved")
    os.symlink(sft, sft)
    one_line([train, "--loss", "dpo", "--resume", dpo, "--steps", "2", "--warmup-steps", "0"] +
             TINY, 1, "--resume " + dpo + ": the --init checkpoint its run started from", sft)
    # A later --model whose weights are cut short is refused, naming the file.
    cut = os.path.join(work, "cut")
    shutil.copytree(ck, cut)
    weights = os.path.join(cut, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) - 8)
    one_line([evaluate, "--model", ck, "--model", cut, "--limit", "2"], 1, weights, alone=True)
    for cmd, option in ((t + ["--train-file", loop], "--train-file"),
                        ([evaluate, "--model", ck, "--sft-file", loop], "--sft-file"),
                        ([evaluate, "--model", ck, "--pref-file", loop], "--pref-file")):
        one_line(cmd, 2, option + ": cannot open " + loop)
    # A missing data file or a directory is a usage error naming the option.
    missing = os.path.join(work, "missing.jsonl")
    for path, problem in ((missing, " does not exist"), (work, " is a directory, not a file")):
        for cmd, option in ((t + ["--train-file", path], "--train-file"),
                            ([evaluate, "--model", ck, "--sft-file", path], "--sft-file"),
                            ([evaluate, "--model", ck, "--pref-file", path], "--pref-file")):
            one_line(cmd, 2, option + ": " + path + problem, alone=True)


def before_work_case(train, work):
    def write(name, text):
        path = os.path.join(work, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    sft = json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n"
    bad_json = write("bad.jsonl", sft + "not json\n")
    no_rejected = write("pref.jsonl", json.dumps({"prompt": "1+1=", "chosen": "2"}) + "\n")
    empty = write("empty.jsonl", "")
    one_kto = write("kto.jsonl", json.dumps({"prompt": "1+1=", "completion": "2",
                                             "label": True}) + "\n")
    metrics = os.path.join(work, "m.jsonl")
    os.makedirs(metrics + ".partial")
    t = [train, "--steps", "2", "--warmup-steps", "0"] + TINY
    for extra, words in (
            (["--train-file", bad_json], (bad_json + ":2: bad JSON",)),
            (["--loss", "dpo", "--train-file", no_rejected], (no_rejected + ":1", '"rejected"')),
            (["--train-file", empty], (empty + ": no examples",)),
            (["--loss", "kto", "--train-file", one_kto], (one_kto, "1 example", "--batch-size 2"))):
        one_line(t + extra, 1, *words, alone=True)
    one_line(t + ["--metrics", metrics], 2, "--metrics", metrics + ".partial", "not a regular file",
             alone=True)
    # A save that fails (files limited to 4 KiB here, as a full disk would) leaves no empty
    # checkpoint directory; --save keeps only the metrics of the steps run (FILE.partial).
    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    saved = os.path.join(work, "new-save")
    one_line([train, "--steps", "2", "--warmup-steps", "0", "--save", saved, "--save-every", "1"] +
             TINY, 1, "checkpoint-1/model.safetensors.tmp: File too large", preexec_fn=small_files)
    if os.listdir(saved) != ["metrics.jsonl.partial"]:
        fail("a failed save left: %s" % os.listdir(saved))
    # About 5.2e10 parameters, within the model layer's 2^36, on 64 ranks: 16 bytes each for the
    # policy and 8 for each further replica, about 25 TiB, exceed any test machine's memory, which
    # the run names before allocating.
    huge = [train, "--steps", "2", "--hidden-size", "65536", "--intermediate-size", "1",
            "--layers", "3", "--heads", "1", "--kv-heads", "1", "--threads", "1",
            "--data-parallel", "64", "--batch-size", "64"]
    one_line(huge, 1, "the model options", "GiB of host memory", "this process may use",
             alone=True)


def file_hazards_case(train, evaluate, bench, work):
    t = [train, "--steps", "2", "--warmup-steps", "0"] + TINY
    ck = os.path.join(work, "ck")
    run(t + ["--save", ck])

    def files(d):
        out = {}
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    out[name] = f.read()
        return out

    before = files(ck)
    ini = os.path.join(work, "empty.ini")
    with open(ini, "w") as f:
        f.write("resume =\n")
    for cmd, option in ((t + ["--resume", "", "--save", ck], "--resume"),
                        (t + ["--init", "", "--save", ck], "--init"),
                        (t + ["--train-file", ""], "--train-file"),
                        (t + ["--save", ""], "--save"),
                        (t + ["--metrics", ""], "--metrics"),
                        (t + ["--chart", ""], "--chart"),
                        (t + ["--config", ""], "--config"),
                        (t + ["--config", ini, "--save", ck], "--resume"),
                        ([evaluate, "--model", ck, "--reference", ""], "--reference"),
                        ([evaluate, "--model", ck, "--json", ""], "--json"),
                        ([evaluate, "--model", ck, "--config", ""], "--config"),
                        ([bench, "--json", "", "--rows", "8", "--hidden", "8", "--vocab", "8"],
                         "--json")):
        one_line(cmd, 2, option + ": the path is empty", alone=True)
    if files(ck) != before:
        fail("a refused run changed the checkpoint " + ck)

    # Files an output writes in place: a directory or a symlink there is refused before the work.
    metrics = os.path.join(work, "m.jsonl")
    os.makedirs(metrics + ".tmp")
    one_line(t + ["--metrics", metrics], 2, "--metrics", metrics + ".tmp", "not a regular file",
             alone=True)
    os.rmdir(metrics + ".tmp")
    victim = os.path.join(work, "victim.txt")
    with open(victim, "w") as f:
        f.write("keep me\n")
    os.symlink(victim, metrics + ".partial")
    one_line(t + ["--metrics", metrics], 2, metrics + ".partial", "not a regular file",
             alone=True)
    with open(victim) as f:
        if f.read() != "keep me\n":
            fail("a symlinked .partial's target was written")
    out_json = os.path.join(work, "e.json")
    os.makedirs(out_json + ".tmp")
    one_line([evaluate, "--model", ck, "--limit", "2", "--json", out_json], 2, "--json",
             out_json + ".tmp", alone=True)

    # A device is not a data file (it was read until memory ran out).
    if os.path.exists("/dev/zero"):
        one_line(t + ["--train-file", "/dev/zero"], 1, "/dev/zero is a device", alone=True)

    # Two runs saving into one directory at once would mix their files: the second is refused.
    held = os.path.join(work, "held")
    os.makedirs(held)
    fd = os.open(held, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        one_line(t + ["--save", held], 1, "--save " + held, "another run is writing into it",
                 alone=True)
    finally:
        os.close(fd)
    if os.listdir(held):
        fail("a refused run wrote into " + held)
    run(t + ["--save", held])  # free again

    # An error quoting a 100 KB key prints a cut line (it printed all of it).
    key = "k" * 100000
    big = os.path.join(work, "big.jsonl")
    with open(big, "w") as f:
        f.write('{"prompt": "1+1=", "completion": "2", "%s": 1, "%s": 2}\n' % (key, key))
    p = one_line(t + ["--train-file", big], 1, big, "bytes left out", alone=True)
    if len(p.stderr) > 2000:
        fail("an error line of %d bytes" % len(p.stderr))
    # The same for 2000 bytes of invalid UTF-8 in an unknown option's name (Boost quotes it).
    invalid = os.fsdecode(b"--" + b"\x80" * 2000)
    p = one_line([train, invalid], 2, "bytes left out", alone=True, errors="surrogateescape")
    if len(p.stderr.encode("utf-8", "surrogateescape")) > 2000:
        fail("an error line of %d bytes" % len(p.stderr))

    # Every save records these options; a state without them is not one of chunkloss-train's.
    resumable = os.path.join(work, "resumable")
    shutil.copytree(ck, resumable)
    state_path = os.path.join(resumable, "trainer_state.json")
    with open(state_path) as f:
        state = json.load(f)
    del state["strings"]["loss"]
    with open(state_path, "w") as f:
        json.dump(state, f)
    one_line(t + ["--resume", resumable], 1, "trainer_state.json records no loss", alone=True)


def utf8_case(train, evaluate, bench, work):
    bad = os.fsdecode(b"\xff\xfe")  # (surrogate escapes: the bytes themselves reach the app)
    ck = os.path.join(work, "ck")
    run([train, "--steps", "1", "--warmup-steps", "0", "--save", ck] + TINY)
    data = os.path.join(work, "x" + bad + ".jsonl")
    with open(data, "w") as f:
        f.write((json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n") * 4)
    ini = os.path.join(work, "c.ini")
    with open(ini, "wb") as f:
        f.write(b"save = " + os.fsencode(os.path.join(work, "s")) + b"\xc0\xaf\n")
    t = [train, "--steps", "1", "--warmup-steps", "0"] + TINY
    out = os.path.join(work, "out" + bad)
    for cmd, option in ((t + ["--save", out], "--save"),
                        (t + ["--train-file", data], "--train-file"),
                        (t + ["--config", ini], "--save"),
                        ([evaluate, "--model", ck, "--limit", "2", "--name", "a" + bad], "--name"),
                        ([evaluate, "--model", ck, "--limit", "2", "--json", out], "--json"),
                        ([bench, "--rows", "8", "--hidden", "8", "--vocab", "8", "--json", out],
                         "--json")):
        one_line(cmd, 2, option + ": not valid UTF-8", alone=True)
    if os.path.exists(out):
        fail("a refused --save or --json was written")
    # A UTF-8 path that is not so once made absolute, as the checkpoint records it.
    cwd = os.path.join(work, "d" + bad)
    os.makedirs(cwd)
    shutil.copy(data, os.path.join(cwd, "x.jsonl"))
    one_line(t + ["--train-file", "x.jsonl", "--save", os.path.join(work, "s")], 2,
             "--train-file x.jsonl (made absolute): not valid UTF-8", alone=True, cwd=cwd)


def main():
    train, evaluate, bench, work, case = sys.argv[1:6]
    work = os.path.join(work, case)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    cases = {"config": lambda: config_case(train, evaluate, work),
             "checkpoint_paths": lambda: checkpoint_paths_case(train, evaluate, work),
             "resume_state": lambda: resume_state_case(train, work),
             "stdin": lambda: stdin_case(train, work),
             "bench_options": lambda: bench_options_case(bench),
             "names": lambda: names_case(train, evaluate, bench, work),
             "metrics": lambda: metrics_case(train, work),
             "outputs": lambda: outputs_case(train, evaluate, bench, work),
             "messages": lambda: messages_case(train, evaluate, bench, work),
             "before_work": lambda: before_work_case(train, work),
             "loss_options": lambda: loss_options_case(train, work),
             "stdout": lambda: stdout_case(train, evaluate, bench, work),
             "utf8": lambda: utf8_case(train, evaluate, bench, work),
             "file_hazards": lambda: file_hazards_case(train, evaluate, bench, work)}
    if case not in cases:
        fail("unknown case " + case)
    cases[case]()
    print("%s: passed" % case)


if __name__ == "__main__":
    main()
