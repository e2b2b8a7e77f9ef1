"""``IndexKCache``: one layer's paged index-K cache as one value (format, views, geometry).

The format travels with the bytes: the writer, the scorers and the selector read the format, the
MXFP4 scale rule and the ``mxfp4_rot`` sign seed off the cache instead of taking them as loose
arguments or inferring them from dtypes. The views are checked once, when the value is made
(``pages.check_index_k_cache``: dtype, shape, inner contiguity, 16-byte alignment of base and page
stride, overlapping pages, and for MXFP4 data and scale views that overlap or disagree on the page
count); a cache that exists is valid, so per-layer calls check nothing about it.

See ``docs/design.md`` (the cache object) for where it sits.
"""

from dataclasses import dataclass

import torch

from .config import IndexKFormat, ScaleRule, parse_format, parse_scale_rule
from .constants import INDEX_DIM, PAGE_SIZE
from .index_k import prepare_index_q
from .pages import alloc_index_k_cache, check_index_k_cache


@dataclass(frozen=True, eq=False)
class IndexKCache:
    """One layer's index-K cache in one ``IndexKFormat``.

    - ``data``: bf16 / e4m3 ``[pages, 128, 128]``, or (MXFP4 formats) packed e2m1 uint8 ``[pages, 128, 64]``;
    - ``scale_e8m0``: the MXFP4 formats' e8m0 uint8 ``[pages, 128, 4]`` (any page stride; the single-region
      8704 B page of ``pages.mxfp4_page_views`` included), None for bf16 / fp8;
    - ``scale_rule``: how the writer picks MXFP4 scales; ``sign_seed``: the ``mxfp4_rot`` rotation's seed.

    Construction validates the views (ValueError naming the view and the rule it broke); the
    storage must match ``fmt`` (``mxfp4`` and ``mxfp4_rot`` share the MXFP4 storage).
    """

    fmt: IndexKFormat
    data: torch.Tensor
    scale_e8m0: torch.Tensor | None = None
    scale_rule: ScaleRule = ScaleRule.RCEIL
    sign_seed: int | None = None

    def __post_init__(self):
        fmt = parse_format(self.fmt)
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "scale_rule", parse_scale_rule(self.scale_rule))
        seed = self.sign_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise ValueError(f"sign_seed must be None or an int in [0, 2^63), got {seed!r} ({type(seed).__name__})")
        stored = check_index_k_cache(self.data, self.scale_e8m0)
        if stored is not self.storage:
            raise ValueError(f"fmt {fmt.value!r} does not match the cache's storage ({stored.value})")

    # ---- constructors ------------------------------------------------------------------------

    @classmethod
    def new(cls, num_pages: int, fmt, device=None, scale_rule=ScaleRule.RCEIL, sign_seed=None,
            single_region: bool = True) -> "IndexKCache":
        """A zeroed cache of ``num_pages`` pages (``pages.alloc_index_k_cache``; MXFP4 in single-region
        8704 B pages unless ``single_region=False``)."""
        fmt = parse_format(fmt)
        data, scale = alloc_index_k_cache(num_pages, fmt, device, single_region)
        return cls(fmt, data, scale, scale_rule, sign_seed)

    @classmethod
    def of(cls, data: torch.Tensor, scale_e8m0: torch.Tensor | None, fmt=None, scale_rule=ScaleRule.RCEIL,
           sign_seed=None) -> "IndexKCache":
        """A cache over existing views; ``fmt`` defaults to the storage format read off them (``mxfp4``
        for uint8 data with scales). Validated as the constructor does."""
        if fmt is None:
            fmt = check_index_k_cache(data, scale_e8m0)
        return cls(fmt, data, scale_e8m0, scale_rule, sign_seed)

    # ---- geometry ----------------------------------------------------------------------------

    @property
    def storage(self) -> IndexKFormat:
        """How the bytes are stored: ``mxfp4`` for both MXFP4 formats (rotated keys are MXFP4 keys), else ``fmt``."""
        return IndexKFormat.MXFP4 if self.fmt.is_mxfp4 else self.fmt

    @property
    def num_pages(self) -> int:
        return self.data.shape[0]

    @property
    def page_size(self) -> int:
        """Token slots per page (one MSA block)."""
        return PAGE_SIZE

    @property
    def head_dim(self) -> int:
        """Features per key."""
        return INDEX_DIM

    @property
    def capacity(self) -> int:
        """Token slots: slot ``loc`` is page ``loc // page_size``, row ``loc % page_size``."""
        return self.num_pages * PAGE_SIZE

    @property
    def device(self) -> torch.device:
        return self.data.device

    def views(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(data, scale_e8m0)``, the form the torch references take."""
        return self.data, self.scale_e8m0

    # ---- the Q side --------------------------------------------------------------------------

    def prepare_q(self, q: torch.Tensor) -> torch.Tensor:
        """Index Q ``[..., 128]`` as every scorer of this cache takes it: rotated by the keys' rotation
        for ``mxfp4_rot`` (bf16 or fp32 Q only: ValueError for e4m3), unchanged otherwise; dtype kept.
        (The CUDA MXFP4 kernel also permutes dims, K and Q alike, but inside the kernel: not here.)"""
        return prepare_index_q(q, self.fmt, self.sign_seed)

    def __repr__(self) -> str:
        scale = None if self.scale_e8m0 is None else tuple(self.scale_e8m0.shape)
        return (f"IndexKCache({self.fmt.value}, data={tuple(self.data.shape)} {self.data.dtype}, scale_e8m0={scale}, "
                f"scale_rule={self.scale_rule.value}, sign_seed={self.sign_seed}, device={self.device})")


def check_cache(cache) -> IndexKCache:
    """``cache`` itself when it is an ``IndexKCache``; TypeError naming the argument otherwise (a raw tensor
    passed where the ops take the cache object)."""
    if not isinstance(cache, IndexKCache):
        raise TypeError(f"cache must be an IndexKCache (m3_kernels.formats), got a {type(cache).__name__}")
    return cache
