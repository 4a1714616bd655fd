"""DiLoCo's wire formats as pure functions of tensors: each encodes a chunk of numbers to bytes and
decodes them, and says how many bytes a chunk takes, so that the meter and the cost model know a
transfer before it is sent. No collective here (hvd_lowcomm.methods.diloco.exchange sends them).

- fp16: float16 under one power-of-two scale per chunk (a float32 beside it).
- int8, int4: integers per block of BLOCK (int8) or BLOCK4 (int4) numbers, one fp32 absmax scale each.
- int2: 4 levels evenly spread over each block of BLOCK4 (±absmax/3, ±absmax), four to a byte.
- sparse: a chunk's top `density` share by magnitude, values at 2 bits (sign, and which of the
  means of the larger and smaller half), positions by Elias-Fano.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from hvd_lowcomm.comm.half_wire import from_half_rows, to_half_rows
from hvd_lowcomm.comm.traffic import FLOAT_BYTES

BLOCK = 256  # numbers per int8 scale: one fp32 scale costs 1/64 of the block's bytes
# numbers per 4-bit scale: 4-bit factors of a pseudo-gradient's weak directions need a scale of
# their own more often (1/8 of the block's bytes)
BLOCK4 = 64
CHUNK = 4096  # numbers per sparse chunk: every chunk sends its own top-k
# numbers int2 codes at a time (a multiple of BLOCK4 and of 4): its temporaries, several times
# the numbers' bytes, stay this small whatever a slice's size, and the bytes are the same
PIECE = 1 << 20
Encode = Callable[[torch.Tensor], torch.Tensor]  # a chunk of numbers -> bytes
Decode = Callable[[torch.Tensor, int], torch.Tensor]  # bytes, how many numbers -> the numbers

# ---------------------------------------------------------------------------------------------
# quantised: fp16, int8, int4, int2


def fp16_encode(chunk: torch.Tensor) -> torch.Tensor:
    """The chunk as float16, multiplied by the power of two that puts its largest value at 2**14
    (a small learning rate's pseudo-gradient of 1e-6 would otherwise lose most of its bits to
    float16's subnormals), then that multiplier as one float32."""
    half, scale = to_half_rows(chunk.reshape(1, -1))
    return torch.cat([half.view(-1).view(torch.uint8), scale.view(-1).view(torch.uint8)])


def fp16_decode(payload: torch.Tensor, numbers: int) -> torch.Tensor:
    half = _view(payload[: 2 * numbers], torch.float16).view(1, -1)
    return from_half_rows(half, _view(payload[2 * numbers :], torch.float32).view(1, 1)).view(-1)


def fp16_bytes(chunk: int) -> int:
    return 2 * chunk + FLOAT_BYTES


def quantise(values: torch.Tensor, levels: int = 127, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Integers in [-levels, levels] (int8) and one fp32 scale per block of `block` numbers
    (absmax / levels)."""
    blocks = math.ceil(len(values) / block)
    padded = torch.zeros(blocks * block, dtype=values.dtype, device=values.device)
    padded[: len(values)] = values
    padded = padded.view(blocks, block)
    scales = padded.abs().amax(dim=1) / levels
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(padded / scales[:, None]).clamp(-levels, levels).to(torch.int8).view(-1), scales


def dequantise(values: torch.Tensor, scales: torch.Tensor, numbers: int, block: int = BLOCK) -> torch.Tensor:
    return (values.view(len(scales), block).float() * scales[:, None]).view(-1)[:numbers]


def int8_encode(chunk: torch.Tensor) -> torch.Tensor:
    """The chunk as int8, then one fp32 scale per block of BLOCK (the last block's padding is
    not sent)."""
    values, scales = quantise(chunk)
    return torch.cat([values[: len(chunk)].view(torch.uint8), scales.view(torch.uint8)])


def int8_decode(payload: torch.Tensor, numbers: int) -> torch.Tensor:
    blocks = math.ceil(numbers / BLOCK)
    values = torch.zeros(blocks * BLOCK, dtype=torch.int8)
    values[:numbers] = payload[:numbers].view(torch.int8)
    return dequantise(values, _view(payload[numbers:], torch.float32), numbers)


def int8_bytes(chunk: int) -> int:
    return chunk + FLOAT_BYTES * math.ceil(chunk / BLOCK)


def int4_encode(chunk: torch.Tensor) -> torch.Tensor:
    """The chunk as 4-bit integers in [-7, 7], two to a byte, then one fp32 scale per block of
    BLOCK4."""
    values, scales = quantise(chunk, levels=7, block=BLOCK4)
    nibbles = (values[: len(chunk)] + 8).to(torch.uint8)
    nibbles = torch.cat([nibbles, nibbles.new_full((len(nibbles) % 2,), 8)]).view(-1, 2)
    return torch.cat([nibbles[:, 0] | (nibbles[:, 1] << 4), scales.view(torch.uint8)])


def int4_decode(payload: torch.Tensor, numbers: int) -> torch.Tensor:
    packed, blocks = payload[: -(-numbers // 2)], math.ceil(numbers / BLOCK4)
    values = torch.zeros(blocks * BLOCK4, dtype=torch.int8)
    values[:numbers] = torch.stack([packed & 15, packed >> 4], 1).view(-1)[:numbers].to(torch.int8) - 8
    return dequantise(values, _view(payload[len(packed) :], torch.float32), numbers, BLOCK4)


def int4_bytes(chunk: int) -> int:
    return -(-chunk // 2) + FLOAT_BYTES * math.ceil(chunk / BLOCK4)


def int2_encode(chunk: torch.Tensor) -> torch.Tensor:
    """The chunk at 2 bits a number, four to a byte: each number as the nearest of 4 levels
    evenly spread over its block's range, ±absmax/3 and ±absmax, then one fp32 scale per block
    of BLOCK4. No number is beyond its block's largest level, so what rounding leaves in error
    feedback stays below a third of a block's largest number however long a signal persists."""
    codes, scales = zip(*(_int2_piece(chunk[i : i + PIECE]) for i in range(0, max(len(chunk), 1), PIECE)))
    return torch.cat([*codes, *(s.view(torch.uint8) for s in scales)])


def _int2_piece(piece: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int2's packed codes and scales of a piece of at most PIECE numbers."""
    blocks = math.ceil(len(piece) / BLOCK4)
    scales = torch.cat([piece.abs(), piece.new_zeros(blocks * BLOCK4 - len(piece))]).view(blocks, BLOCK4).amax(1)
    levels = torch.repeat_interleave(scales, BLOCK4)[: len(piece)]
    unit = torch.where(levels > 0, piece / levels.clamp_min(torch.finfo(torch.float32).tiny), 0)
    codes = torch.round((unit + 1) * 1.5).clamp(0, 3).to(torch.uint8)  # [-1, 1] -> {0, 1, 2, 3}
    return pack_bits(codes.view(1, -1), 2).view(-1), scales


def int2_decode(payload: torch.Tensor, numbers: int) -> torch.Tensor:
    packed = -(-numbers // 4)
    scales = _view(payload[packed:], torch.float32)
    out = torch.empty(numbers)
    for i in range(0, numbers, PIECE):
        n = min(PIECE, numbers - i)
        codes = unpack_bits(payload[i // 4 : i // 4 + -(-n // 4)].view(1, -1), n, 2).view(-1)
        levels = torch.repeat_interleave(scales[i // BLOCK4 : i // BLOCK4 + -(-n // BLOCK4)], BLOCK4)[:n]
        out[i : i + n] = (codes.float() / 1.5 - 1) * levels
    return out


def int2_bytes(chunk: int) -> int:
    return -(-chunk // 4) + FLOAT_BYTES * math.ceil(chunk / BLOCK4)


@dataclass(frozen=True)
class Codec:
    """A number format on the wire: `encode` a chunk to bytes, `decode` them, `size` of a
    chunk's bytes, `per_number` its bytes a number (scales included) for budgets."""

    encode: Encode
    decode: Decode
    size: Callable[[int], int]
    per_number: float


FP16 = Codec(fp16_encode, fp16_decode, fp16_bytes, 2.0)
INT8 = Codec(int8_encode, int8_decode, int8_bytes, 1 + FLOAT_BYTES / BLOCK)
INT4 = Codec(int4_encode, int4_decode, int4_bytes, 0.5 + FLOAT_BYTES / BLOCK4)
INT2 = Codec(int2_encode, int2_decode, int2_bytes, 0.25 + FLOAT_BYTES / BLOCK4)
FACTOR_CODECS = {8: INT8, 4: INT4}
QUANTISED_CODECS = {"fp16": FP16, "int8": INT8, "int2": INT2}  # diloco.compression's quantised forms


# ---------------------------------------------------------------------------------------------
# sparse: chunked top-k at 2 bits with an error-feedback accumulator


def sparse_layout(numbers: int, density: float) -> tuple[int, int, int]:
    """(chunks, chunk length, kept per chunk) of a slice of `numbers`: the fewest chunks of at
    most CHUNK, all of one length, so at most chunks - 1 numbers are padding (a last chunk
    padded to CHUNK would send `density` of CHUNK for what may be a few numbers, which costs
    a small model's slices most)."""
    chunks = max(1, -(-numbers // CHUNK))
    chunk = max(1, -(-numbers // chunks))
    return chunks, chunk, max(1, round(density * chunk))


def sparse_bytes(numbers: int, density: float) -> int:
    """Per chunk: its k positions (Elias-Fano), k 2-bit codes, two fp32 magnitudes."""
    chunks, chunk, k = sparse_layout(numbers, density)
    return chunks * (positions_bytes(chunk, k) + -(-k // 4) + 2 * FLOAT_BYTES)


# Positions by Elias-Fano (Elias 1974, Fano 1971): k ascending offsets below u cost k·(2 +
# log2(u/k)) bits at most, a fixed size (so the meter and the cost model know it before sending),
# close to the entropy of choosing k of u (docs: diloco, on the sparse form). Each offset's low
# floor(log2(u/k)) bits go as they are; the rest, its "high part", as a unary run: bit
# high_i + i of a k + u/2^low bit vector is set for the i-th offset.


def elias_fano_layout(chunk: int, k: int) -> tuple[int, int, int]:
    """(low bits per offset, bits of the high parts' vector, bytes of the low parts) for k
    offsets below `chunk`."""
    low = (chunk // k).bit_length() - 1  # floor(log2(chunk / k))
    return low, k + ((chunk - 1) >> low) + 1, -(-k * low // 8)


def positions_bytes(chunk: int, k: int) -> int:
    _, high_bits, low_bytes = elias_fano_layout(chunk, k)
    return low_bytes + -(-high_bits // 8)


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Rows of integers below 2**width as `width` bits each, every row padded to whole bytes."""
    bits = (values.unsqueeze(-1) >> torch.arange(width, dtype=values.dtype)) & 1  # in the values' dtype
    return _pack_rows(bits.reshape(len(values), -1))


def unpack_bits(packed: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """pack_bits' integers: uint8 up to 8 bits (a byte a number where int64 takes eight), else int64."""
    bits = _unpack_rows(packed, count * width).view(len(packed), count, width)
    dtype = torch.uint8 if width <= 8 else torch.int64
    values = torch.zeros(len(packed), count, dtype=dtype)
    for i in range(width):
        values |= bits[..., i].to(dtype) << i
    return values


def _pack_rows(bits: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.packbits(bits.to(torch.uint8).numpy(), axis=1, bitorder="little"))


def _unpack_rows(packed: torch.Tensor, count: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(packed.numpy(), axis=1, count=count, bitorder="little"))


def elias_fano_encode(offsets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Rows of k distinct ascending offsets below `chunk`, as rows of positions_bytes(chunk, k)
    bytes: the low parts, then the high parts' vector."""
    rows, k = offsets.shape
    low, high_bits, _ = elias_fano_layout(chunk, k)
    high = torch.zeros(rows, high_bits, dtype=torch.uint8).scatter_(1, (offsets >> low) + torch.arange(k), 1)
    return torch.cat([pack_bits(offsets & ((1 << low) - 1), low), _pack_rows(high)], dim=1)


def elias_fano_decode(packed: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    low, high_bits, low_bytes = elias_fano_layout(chunk, k)
    rows = len(packed)
    set_bits = _unpack_rows(packed[:, low_bytes:], high_bits).nonzero()[:, 1].view(rows, k)  # k in each row, in order
    return ((set_bits - torch.arange(k)) << low) | unpack_bits(packed[:, :low_bytes], k, low)


def sparse_encode(values: torch.Tensor, density: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The payload (uint8) and what it decodes to (dense, like `values`)."""
    chunks, chunk, k = sparse_layout(len(values), density)
    x = torch.cat([values, values.new_zeros(chunks * chunk - len(values))]).view(chunks, chunk)
    offsets = x.abs().topk(k, dim=1).indices.sort(dim=1).values
    kept = x.gather(1, offsets)
    magnitude = kept.abs()
    large = magnitude >= magnitude.median(dim=1, keepdim=True).values
    levels = torch.stack([_mean_where(magnitude, ~large), _mean_where(magnitude, large)], dim=1)  # chunks × 2
    codes = (kept < 0).to(torch.uint8) * 2 + large.to(torch.uint8)
    payload = torch.cat(
        [
            elias_fano_encode(offsets, chunk).reshape(-1),
            pack_bits(codes, 2).reshape(-1),
            levels.reshape(-1).contiguous().view(torch.uint8),
        ]
    )
    return payload, sparse_decode(payload, len(values), density)


def sparse_decode(payload: torch.Tensor, numbers: int, density: float) -> torch.Tensor:
    chunks, chunk, k = sparse_layout(numbers, density)
    positions, width = chunks * positions_bytes(chunk, k), -(-k // 4)
    offsets = elias_fano_decode(payload[:positions].view(chunks, -1), chunk, k)
    codes = unpack_bits(payload[positions : positions + chunks * width].view(chunks, width), k, 2)
    levels = _view(payload[positions + chunks * width :], torch.float32).view(chunks, 2)
    kept = levels.gather(1, (codes & 1).long()) * (1 - 2 * (codes >> 1).float())
    out = torch.zeros(chunks, chunk).scatter_(1, offsets, kept)
    return out.view(-1)[:numbers]


def _view(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes of a received payload as `dtype` (copied: a part of a gathered buffer may start at
    an offset the wider type cannot view)."""
    return payload.clone().view(dtype)


def _mean_where(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row, the mean of `values` where `mask` holds (0 where it never does)."""
    return (values * mask).sum(1) / mask.sum(1).clamp(min=1)
