"""The fixed orthonormal rotation of the ``mxfp4_rot`` format.

``R = H_128 / sqrt(128)`` where ``H_128`` is the Sylvester Walsh-Hadamard matrix
(``H_1 = [1]``, ``H_2n = [[H, H], [H, -H]]``), optionally times a diagonal of random signs
(``sign_seed``; ``R = H_128 diag(s) / sqrt(128)``). The served format uses ``sign_seed=None``:
plain Hadamard, symmetric and its own inverse. One MXFP4 group is 32 elements, and each rotated
element mixes all 128, so one outlier channel spreads over every group instead of crushing one.

Keys: ``k_rot = R k`` and queries ``q_rot = R q``; ``q_rot . k_rot = q . k`` exactly. The reference
computes ``R x`` in float64 and rounds once to fp32.
"""

import functools
import math

import torch

from .constants import INDEX_DIM


@functools.lru_cache(maxsize=8)
def _hadamard_f64(n: int, sign_seed: int | None) -> torch.Tensor:
    if n <= 0 or n & (n - 1):
        raise ValueError(f"n must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(n)
    if sign_seed is not None:
        gen = torch.Generator().manual_seed(sign_seed)
        signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1
        h = h * signs  # columns scaled: H diag(s)
    return h


def rotation_matrix(n: int = INDEX_DIM, sign_seed: int | None = None, dtype=torch.float32, device=None):
    """``[n, n]`` orthonormal rotation ``R``; apply as ``x @ R.T``.

    Cached per (n, seed, dtype, device): after the first call on a device no host-to-device copy
    happens, so calls inside a captured CUDA graph (after a warm-up call) are capture-safe. Treat
    the result as read-only.
    """
    return _rotation_on(n, sign_seed, dtype, torch.device(device) if device is not None else torch.device("cpu"))


@functools.lru_cache(maxsize=32)
def _rotation_on(n: int, sign_seed: int | None, dtype, device: torch.device) -> torch.Tensor:
    return _hadamard_f64(n, sign_seed).to(dtype=dtype, device=device)


def rotate(x: torch.Tensor, sign_seed: int | None = None) -> torch.Tensor:
    """``R x`` along the last dim (128), in float64, rounded once to fp32."""
    r = rotation_matrix(x.shape[-1], sign_seed, torch.float64, x.device)
    return (x.double() @ r.T).float()
