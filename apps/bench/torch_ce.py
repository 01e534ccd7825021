#!/usr/bin/env python3
"""PyTorch eager side-by-side for chunkloss-bench --loss ce.

Times F.cross_entropy((x @ W.T).float(), y) forward+backward (mean over valid rows, 1 in 7 rows
ignored; --no-upcast: on the logits as they are) and the three bare GEMMs (logits, dX, dW) in the
same process, alternating the two in each round as chunkloss-bench does, after warm-up (median).
On CUDA (bf16 inputs): CUDA events, and the peak device memory beyond inputs and gradients. With
--device cpu (fp32 inputs, --threads): wall-clock time, and the peak RSS growth of one call
(VmHWM after a /proc/self/clear_refs reset), as chunkloss-bench measures on the CPU.
Run on the GPU machine: python3 apps/bench/torch_ce.py --shapes 8192x4096x128256 16384x4096x128256
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def elapsed_ms(fn, device):
    if device == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def interleaved(fns, repeats, device):
    """One warm-up call of each, then `repeats` rounds calling each once; the medians."""
    for fn in fns:
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for t, fn in zip(times, fns):
            t.append(elapsed_ms(fn, device))
    return [statistics.median(t) for t in times]


def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no " + field + " in /proc/self/status")


def peak_growth_cpu(fn):
    """Peak RSS growth of one call: VmHWM after a clear_refs reset minus VmRSS at the reset."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status_bytes("VmRSS")
    fn()
    return status_bytes("VmHWM") - base


def case(n, h, v, repeats, dtype, upcast, device):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, h, device=device, dtype=dtype, generator=g).requires_grad_()
    w = (torch.randn(v, h, device=device, dtype=dtype, generator=g) * (2.0 / h**0.5)).requires_grad_()
    y = torch.randint(0, v, (n,), device=device, generator=g)
    y[3::7] = -100

    def floor():
        z = x.detach() @ w.detach().T
        z @ w.detach()
        z.T @ x.detach()

    def eager():
        x.grad = None
        w.grad = None
        logits = x @ w.T
        F.cross_entropy(logits.float() if upcast else logits, y, ignore_index=-100).backward()

    eager()  # allocate the gradient buffers before measuring the peak
    if device == "cpu":
        extra = peak_growth_cpu(eager)
        where = f"cpu, {torch.get_num_threads()} threads"
    else:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        eager()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        where = torch.cuda.get_device_name()
    floor_ms, eager_ms = interleaved([floor, eager], repeats, device)
    return {"loss": "ce", "device": device, "impl": "torch_eager", "rows": n, "hidden": h,
            "vocab": v, "dtype": str(dtype).replace("torch.", ""), "upcast": upcast,
            "time_ms": eager_ms, "floor_ms": floor_ms, "ratio": eager_ms / floor_ms,
            "extra_bytes": extra, "repeats": repeats, "torch": torch.__version__, "where": where,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["8192x4096x128256"], help="NxHxV (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats (default %(default)s)")
    ap.add_argument("--no-upcast", action="store_true",
                    help="cross-entropy on the bf16 logits (default: upcast to fp32 first)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda: bf16 inputs; cpu: fp32 inputs (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (default %(default)s)")
    ap.add_argument("--json", help="write the results as a JSON array to this file")
    a = ap.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    where = f"cpu, {torch.get_num_threads()} threads" if a.device == "cpu" else torch.cuda.get_device_name()
    print(datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), where,
          "torch", torch.__version__)
    out = []
    for s in a.shapes:
        n, h, v = (int(t) for t in s.split("x"))
        r = case(n, h, v, a.repeats, dtype, not a.no_upcast, a.device)
        out.append(r)
        print(f"torch eager {n}x{h}x{v}: {r['time_ms']:.2f} ms, floor {r['floor_ms']:.2f} ms, "
              f"ratio {r['ratio']:.3f}, extra {r['extra_bytes'] / 2**20:.1f} MiB")
        if a.device == "cuda":
            torch.cuda.empty_cache()
    print("command: python3 " + " ".join(sys.argv))
    if a.json:
        with open(a.json + ".tmp", "w") as f:
            json.dump(out, f, indent=1)
        os.replace(a.json + ".tmp", a.json)


if __name__ == "__main__":
    main()
