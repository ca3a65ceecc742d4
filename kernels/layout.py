"""The byte layouts a quantized matrix takes on the GPU: the GGUF's own blocks, or aligned
"planes" (field by field, each plane 16-byte aligned) so that kernels read every field with
128-bit loads. A leaf module of the kernels package: the kernels and :class:`QuantWeight`
import it; it imports no kernel.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from localllm.gguf.quants import block_format

# ---- aligned weight planes ----------------------------------------------------------------------
#
# Blocks whose size is not a multiple of 16 bytes (Q4_0: 18, IQ4_NL: 18, Q5_0: 22, Q8_0: 34,
# Q6_K: 210, IQ4_XS: 136, Q2_K: 84, Q3_K: 110, MXFP4: 17) leave their fields only 1-, 2-,
# 4- or 8-byte aligned in the GGUF layout, so a kernel cannot read them with 128-bit
# loads. The "planes" layout stores the same bytes field by field: plane i holds field i of every block of the matrix, blocks in file order,
# and starts on a 16-byte boundary. Bit-exact: only the byte order changes.

# type -> the fields of a block as (byte offset, size), in plane order (the weight bits first).
PLANES: dict[T, tuple[tuple[int, int], ...]] = {
    T.Q4_0: ((2, 16), (0, 2)),  # qs[16] | d
    T.IQ4_NL: ((2, 16), (0, 2)),  # qs[16] | d
    T.Q5_0: ((6, 16), (2, 4), (0, 2)),  # qs[16] | qh[4] | d
    T.Q8_0: ((2, 16), (18, 16), (0, 2)),  # qs[0:16] | qs[16:32] | d
    T.Q6_K: ((0, 128), (128, 64), (192, 16), (208, 2)),  # ql | qh | scales | d
    T.IQ4_XS: ((8, 128), (0, 8)),  # qs[128] | d, scales_h, scales_l[4]
    T.Q2_K: ((16, 64), (0, 16), (80, 4)),  # qs[64] | scales[16] | d, dmin
    T.Q3_K: ((32, 64), (0, 32), (96, 12), (108, 2)),  # qs[64] | hmask[32] | scales[12] | d
    T.MXFP4: ((1, 16), (0, 1)),  # qs[16] | e
}
LAYOUTS = ("blocks", "planes")


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def plane_offsets(qtype: T, n_blocks: int) -> tuple[list[int], int]:
    """Byte offset of each plane of ``n_blocks`` blocks of ``qtype`` and the total byte count
    (at most 15 padding bytes per plane beyond the blocks' own bytes)."""
    offs, end = [], 0
    for _, size in PLANES[qtype]:
        offs.append(_align16(end))
        end = offs[-1] + n_blocks * size
    return offs, end


def to_planes(blocks: torch.Tensor, qtype: T) -> torch.Tensor:
    """uint8 (n_blocks, type_size) ggml blocks -> flat uint8 planes (see :data:`PLANES`),
    with torch operations on the blocks' device."""
    n_blocks = blocks.shape[0]
    offs, total = plane_offsets(qtype, n_blocks)
    out = torch.zeros(total, dtype=torch.uint8, device=blocks.device)
    for (src, size), dst in zip(PLANES[qtype], offs):
        out[dst : dst + n_blocks * size].view(n_blocks, size).copy_(blocks[:, src : src + size])
    return out


def from_planes(planes: torch.Tensor, qtype: T, n_blocks: int) -> torch.Tensor:
    """The inverse of :func:`to_planes`: uint8 (n_blocks, type_size) ggml blocks."""
    offs, _ = plane_offsets(qtype, n_blocks)
    out = torch.empty((n_blocks, block_format(qtype).type_size), dtype=torch.uint8,
                      device=planes.device)  # fmt: skip
    for (src, size), dst in zip(PLANES[qtype], offs):
        out[:, src : src + size] = planes[dst : dst + n_blocks * size].view(n_blocks, size)
    return out


__all__ = ["LAYOUTS", "PLANES", "block_format", "from_planes", "plane_offsets", "to_planes"]
