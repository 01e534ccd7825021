#!/usr/bin/env python3
"""PyTorch eager side-by-side for chunkloss-bench --loss ce --device cuda.

Times F.cross_entropy((x @ W.T).float(), y) forward+backward (bf16 inputs, mean over valid rows,
1 in 7 rows ignored; --no-upcast: on the bf16 logits) and the three bare GEMMs (logits, dX, dW)
in the same process, alternating the two in each round as chunkloss-bench does, with CUDA events
after warm-up (median), and the peak device memory beyond inputs and gradients.
Run on the GPU machine: python3 apps/bench/torch_ce.py --shapes 8192x4096x128256 16384x4096x128256
"""
import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F


def elapsed_ms(fn):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def interleaved(fns, repeats):
    """One warm-up call of each, then `repeats` rounds calling each once; the medians."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for t, fn in zip(times, fns):
            t.append(elapsed_ms(fn))
    return [statistics.median(t) for t in times]


def case(n, h, v, repeats, dtype, upcast):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", dtype=dtype, generator=g).requires_grad_()
    w = (torch.randn(v, h, device="cuda", dtype=dtype, generator=g) * (2.0 / h**0.5)).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
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
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    eager()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    floor_ms, eager_ms = interleaved([floor, eager], repeats)
    return {"loss": "ce", "device": "cuda", "impl": "torch_eager", "rows": n, "hidden": h, "vocab": v,
            "dtype": str(dtype).replace("torch.", ""), "upcast": upcast, "time_ms": eager_ms,
            "floor_ms": floor_ms, "ratio": eager_ms / floor_ms, "extra_bytes": extra,
            "repeats": repeats, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["8192x4096x128256"], help="NxHxV (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats (default %(default)s)")
    ap.add_argument("--no-upcast", action="store_true",
                    help="cross-entropy on the bf16 logits (default: upcast to fp32 first)")
    ap.add_argument("--json", help="write the results as a JSON array to this file")
    a = ap.parse_args()
    print(datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
          torch.cuda.get_device_name(), "torch", torch.__version__)
    out = []
    for s in a.shapes:
        n, h, v = (int(t) for t in s.split("x"))
        r = case(n, h, v, a.repeats, torch.bfloat16, not a.no_upcast)
        out.append(r)
        print(f"torch eager {n}x{h}x{v}: {r['time_ms']:.2f} ms, floor {r['floor_ms']:.2f} ms, "
              f"ratio {r['ratio']:.3f}, extra {r['extra_bytes'] / 2**30:.2f} GiB")
        torch.cuda.empty_cache()
    print("command: python3 " + " ".join(sys.argv))
    if a.json:
        with open(a.json + ".tmp", "w") as f:
            json.dump(out, f, indent=1)
        os.replace(a.json + ".tmp", a.json)


if __name__ == "__main__":
    main()
