#!/usr/bin/env python3
"""A rounding model of the CUDA cross-entropy gradients against float64 (an analysis aid beside
the 2026-12-04 results; not part of the build, needs numpy).

The inputs are the bench's: hidden ~ N(0, 1), weight ~ N(0, 4/H), both rounded to bf16, uniform
targets, 1 in 7 rows ignored, and the mean over valid rows. The GEMMs run in float64 here. The
model rounds only where the library rounds:
- the fp32 logits (optionally to bf16);
- the bf16 gradient tile;
- the bf16 outputs.

    python3 rounding-model.py      (about 30 s; prints rounding-model.txt's lines)
"""
import numpy as np


def bf16(a):
    """Rounds fp32 values to the nearest bf16 (ties to even), returned as fp32."""
    b = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


rng = np.random.default_rng(1)
N, H, V = 1024, 512, 32768
x = bf16(rng.standard_normal((N, H))).astype(np.float64)
w = bf16(rng.standard_normal((V, H)) * np.sqrt(4.0 / H)).astype(np.float64)
y = rng.integers(0, V, N)
valid = (np.arange(N) % 7) != 3
D = int(valid.sum())
z64 = x @ w.T
zmax = z64.max(1, keepdims=True)
p64 = np.exp(z64 - zmax - np.log(np.exp(z64 - zmax).sum(1, keepdims=True)))
onehot = np.zeros((N, V))
onehot[np.arange(N), y] = 1
g64 = (p64 - onehot) * valid[:, None] / D
dx64, dw64 = g64 @ w, g64.T @ x
mant, e = np.frexp(1.0 / D)  # 1/D = mant * 2^e, mant in [0.5, 1)


def tile_of(logits_bf16, coef):
    """The bf16 gradient tile coef (p - y) from fp32 (or bf16) logits, fp32 math."""
    z = z64.astype(np.float32)
    if logits_bf16:
        z = bf16(z)
    zm = z.max(1, keepdims=True)
    lse = np.log(np.exp(z - zm).sum(1, keepdims=True, dtype=np.float32)) + zm
    p = np.exp(z - lse)
    return bf16((p - onehot.astype(np.float32)) * valid[:, None] * np.float32(coef)).astype(np.float64)


print(f"N={N} H={H} V={V}, D={D}, 1/D = {mant} * 2^{e}")
print(f"bf16 storage of the exact gradients alone: dX {rel(bf16(dx64), dx64):.3e}, "
      f"dW {rel(bf16(dw64), dw64):.3e}")
for logits_bf16 in (False, True):
    for whole in (False, True):
        t = tile_of(logits_bf16, 1.0 / D if whole else 2.0**e)
        alpha = 1.0 if whole else mant
        dx, dw = bf16(alpha * (t @ w)), bf16(alpha * (t.T @ x))
        print(f"logits {'bf16' if logits_bf16 else 'fp32'}, tile "
              f"{'(1/D)(p - y), alpha 1' if whole else '2^e (p - y), alpha = mantissa'}: "
              f"dX {rel(dx, dx64):.3e}, dW {rel(dw, dw64):.3e}")
# The library's dW over two chunks: the first accumulated unscaled in bf16, the last GEMM
# dw = alpha (dw + tile^T x), rounded once more.
t = tile_of(False, 2.0**e)
h = N // 2
dw1 = bf16(t[:h].T @ x[:h]).astype(np.float64)
dw = bf16(mant * (dw1 + t[h:].T @ x[h:]))
print(f"logits fp32, tile 2^e (p - y), dW over two chunks, alpha deferred: dW {rel(dw, dw64):.3e}")
