"""The one owner of the index-K formats: constants, named choices, pack/unpack, page views."""

from .config import IndexKFormat, ScaleRule, parse_format, parse_scale_rule
from . import constants
from .constants import *  # noqa: F403
from .fp8 import FP8_DTYPE
from .index_k import dequantize_index_k, prepare_index_q, quantize_index_k
from .mxfp4 import (
    dequantize_mxfp4,
    e2m1_decode,
    e2m1_encode,
    e8m0_scale,
    e8m0_to_float,
    pack_e2m1,
    quantize_mxfp4,
    unpack_e2m1,
)
from .pages import alloc_index_k_cache, check_index_k_cache, check_mxfp4_views, mxfp4_page_views
from .cache import IndexKCache, check_cache
from .rotation import rotate, rotation_matrix

__all__ = [
    *(name for name in vars(constants) if name.isupper()),
    "FP8_DTYPE",
    "IndexKCache",
    "check_cache",
    "IndexKFormat",
    "ScaleRule",
    "alloc_index_k_cache",
    "check_index_k_cache",
    "check_mxfp4_views",
    "dequantize_index_k",
    "dequantize_mxfp4",
    "e2m1_decode",
    "e2m1_encode",
    "e8m0_scale",
    "e8m0_to_float",
    "mxfp4_page_views",
    "pack_e2m1",
    "parse_format",
    "parse_scale_rule",
    "prepare_index_q",
    "quantize_index_k",
    "quantize_mxfp4",
    "rotate",
    "rotation_matrix",
    "unpack_e2m1",
]
