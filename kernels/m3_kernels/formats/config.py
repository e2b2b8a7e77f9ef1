"""Named choices of the index-K formats (string-valued enums, chosen by name)."""

from enum import Enum

from .constants import BF16_TOKEN_BYTES, FP8_TOKEN_BYTES, MXFP4_TOKEN_BYTES


class IndexKFormat(str, Enum):
    """How the index-K cache stores one 128-dim key.

    - ``bf16``: bfloat16, 256 B/token (SGLang's default; the control).
    - ``fp8``: float8 e4m3fn with unit scale, 128 B/token (what vLLM, ATOM and SGLang ship).
    - ``mxfp4``: OCP MX fp4, e2m1 data + one e8m0 scale per 32 elements, 68 B/token.
    - ``mxfp4_rot``: ``mxfp4`` of the key rotated by a fixed orthonormal 128x128 Hadamard
      matrix; the query is rotated by the same matrix, so q.k is preserved. 68 B/token.
    """

    BF16 = "bf16"
    FP8 = "fp8"
    MXFP4 = "mxfp4"
    MXFP4_ROT = "mxfp4_rot"

    @property
    def is_mxfp4(self) -> bool:
        return self in (IndexKFormat.MXFP4, IndexKFormat.MXFP4_ROT)

    @property
    def is_rotated(self) -> bool:
        return self is IndexKFormat.MXFP4_ROT

    @property
    def token_bytes(self) -> int:
        """Bytes per token per layer."""
        return {
            IndexKFormat.BF16: BF16_TOKEN_BYTES,
            IndexKFormat.FP8: FP8_TOKEN_BYTES,
            IndexKFormat.MXFP4: MXFP4_TOKEN_BYTES,
            IndexKFormat.MXFP4_ROT: MXFP4_TOKEN_BYTES,
        }[self]


class ScaleRule(str, Enum):
    """How an MXFP4 group's e8m0 exponent ``e`` is chosen from its largest magnitude ``amax``.

    - ``rceil`` (default): ``e = ceil(log2(amax / 6))``, the smallest power of two for which
      ``amax / 2^e <= 6``; no element ever clips. The rule of NVIDIA's cvt.rp.satfinite.ue8m0,
      FlashInfer, DeepSeek-V4 and aiter's HIP quantizer.
    - ``floor``: ``e = floor(log2(amax)) - 2`` (OCP MX v1.0 section 6.3, torchao's default);
      ``amax / 2^e`` lies in [4, 8), so values above 6 saturate to 6.

    Both clamp the biased exponent to [1, 254]: a zero or tiny group gets byte 1, and bytes 0
    and 255 are never written.
    """

    RCEIL = "rceil"
    FLOOR = "floor"


def _validate_choice(enum_cls, value, arg_name: str):
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        choices = ", ".join(m.value for m in enum_cls)
        raise ValueError(f"{arg_name} must be one of [{choices}], got {value!r}") from None


def parse_format(value, arg_name: str = "index_k_format") -> IndexKFormat:
    """``IndexKFormat`` from a name; ValueError naming the choices otherwise."""
    return _validate_choice(IndexKFormat, value, arg_name)


def parse_scale_rule(value, arg_name: str = "scale_rule") -> ScaleRule:
    """``ScaleRule`` from a name; ValueError naming the choices otherwise."""
    return _validate_choice(ScaleRule, value, arg_name)
