"""Every number the index-K formats need. Kernels, pools and tests import these names."""

# Geometry of MiniMax-M3's index branch.
INDEX_DIM = 128  # features per index key / index query head
PAGE_SIZE = 128  # tokens per cache page == tokens per MSA block
BLOCK_SIZE = PAGE_SIZE  # MSA scoring block (sparse_block_size)
TOPK_BLOCKS = 16  # sparse_topk_blocks
LOCAL_BLOCKS = 1  # sparse_local_block
INIT_BLOCKS = 0  # sparse_init_block (sink blocks); M3 uses none

# e2m1 (OCP MX v1.0, section 5.3.3): 1 sign, 2 exponent (bias 1), 1 mantissa bit. No inf, no NaN.
F4_E2M1_MAX = 6.0
F4_E2M1_SIGN_BIT = 0x8
F4_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code 0..7
# Rounding thresholds on |x| / 2^e for round-to-nearest-even onto F4_E2M1_MAGNITUDES.
# A magnitude equal to a "_UP" threshold rounds up (the upper neighbour has the even code),
# one equal to a "_DOWN" threshold rounds down.
F4_E2M1_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
F4_E2M1_TIES_UP = (0.75, 1.75, 3.5)

# e8m0 (OCP MX v1.0, section 5.4.1): 2^(byte - 127); 0xFF is NaN; no zero, no sign.
E8M0_EXPONENT_BIAS = 127
E8M0_NAN = 255
E8M0_MIN_WRITTEN = 1  # the writer never emits byte 0 (2^-127) ...
E8M0_MAX_WRITTEN = 254  # ... nor 255 (NaN)
# Inputs saturate here: the largest magnitude whose MXFP4 encoding dequantizes finitely in fp32.
MXFP4_INPUT_MAX = 6.0 * 2.0**125  # 2.55e38

MX_GROUP_SIZE = 32  # elements sharing one e8m0 scale
MX_GROUPS_PER_TOKEN = INDEX_DIM // MX_GROUP_SIZE  # 4

# Bytes per token per layer.
MXFP4_DATA_BYTES = INDEX_DIM // 2  # 64: two e2m1 codes per byte
MXFP4_SCALE_BYTES = MX_GROUPS_PER_TOKEN  # 4
MXFP4_TOKEN_BYTES = MXFP4_DATA_BYTES + MXFP4_SCALE_BYTES  # 68
MXFP4_PAGE_DATA_BYTES = PAGE_SIZE * MXFP4_DATA_BYTES  # 8192
MXFP4_PAGE_SCALE_BYTES = PAGE_SIZE * MXFP4_SCALE_BYTES  # 512
MXFP4_PAGE_BYTES = MXFP4_PAGE_DATA_BYTES + MXFP4_PAGE_SCALE_BYTES  # 8704
FP8_TOKEN_BYTES = INDEX_DIM  # 128
BF16_TOKEN_BYTES = 2 * INDEX_DIM  # 256

FP8_E4M3_MAX = 448.0
BF16_MAX = 3.3895313892515355e38  # largest finite bfloat16

VIEW_ALIGN_BYTES = 16  # base pointers and page strides of cache views
