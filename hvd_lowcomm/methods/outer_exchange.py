"""How groups combine their pseudo-gradients across the slow network: DiLoCo's column exchange.

Rank i of every group holds the same slice of each fragment's pseudo-gradient Δ (hvd_lowcomm.
methods.diloco); the exchange gives each of them the mean over the groups (the column). One
class per `diloco.compression`:

- none:     fp32 allreduce.
- fp16, int8 (`Quantised`): reduce-scatter of quantised chunks, reduction in fp32, allgather of
            the quantised result (torchft's quantised allreduce): chunk j of the slice goes to
            column member j by alltoall, which sums what it receives in fp32 and quantises the
            mean; an allgather returns every mean chunk. A rank sends 2(G-1)/G of its slice's
            quantised bytes, as a ring allreduce would: flat in the number of groups G, where an
            allgather of every group's slice sends (G-1) times it. int8 scales each block of
            256 numbers by its absmax; error feedback keeps what both roundings dropped: a
            member's own, and the mean's in an accumulator of the chunk's owner, added to
            the next mean it rounds (as sparse's owner does).
            fp16 scales each chunk by a power of two (a float32 beside it), so that the
            pseudo-gradients of a small learning rate keep float16's full precision.
- int2 (`Quantised`): as int8, at 2 bits a number on 4 levels evenly spread over each
            block of 64 (±absmax/3, ±absmax): under a tenth of fp32's bytes where every number
            moves each exchange, where top-k leaves most of them waiting in its error feedback.
- sparse (`Sparse`, SparseLoCo, arXiv 2508.15706): an error-feedback accumulator e <- βe + Δ;
            each chunk of at most CHUNK numbers sends its top `density` share of e by magnitude,
            values at 2 bits (sign, and which of two magnitudes: the means of the larger and
            smaller half), positions by Elias-Fano (about 2 + log2(1 / density) bits each, where
            SparseLoCo's offsets take 12); what was sent leaves e. At 2 groups the
            contributions are allgathered and averaged, as SparseLoCo does. Beyond, an allgather
            would send G-1 times a slice's sparse bytes, so it is reduced like the quantised
            forms and stays flat in G (Ok-Topk, Li and Hoefler 2022, does the same): member j
            receives every member's sparse part j, sums them in fp32, and sends back the top
            `owner_density` (three times density unless set) of that mean at 2 bits; its own error
            feedback keeps what this second selection leaves out (the groups' supports differ,
            so the mean is up to G times denser) for the next exchange. With
            `diloco.keep_unsent` (the default) DiLoCo takes a group's accumulator after each
            exchange (`take_unsent`; `diloco.unsent_share` of it) and keeps it on the group's
            model instead: Δ, measured from the global model, then carries it, and the group
            trains on from it meanwhile.
- lowrank (`LowRank`): PowerSGD on each matrix's pseudo-gradient (the seed's premise: an
            update is low-rank): P = M Q, mean, orthogonalise, Q = Mᵀ P, mean; error feedback and
            warm start of Q across syncs. A slice cuts matrices along rows, so each whole-row
            block of a tensor is a matrix; vectors and cut rows go dense. Each matrix's rank
            is what its part of a byte budget buys (`diloco.factor_share` of fp32's bytes, every
            matrix compressed alike), or one fixed `diloco.rank`. Both means are reduce-
            scatters as above, the factors in 4 bits (`diloco.factor_bits`; 64 numbers to a
            scale), the dense numbers in int8. P is re-orthogonalised, so its rounding only
            blurs the subspace; every rounding of Q and of the dense numbers is fed back: a
            member's own chunks' by its error feedback, the mean's by the chunk's owner (G
            times it into its own error, which a later mean divides by G), so 4 bits lose
            nothing but time.

`start()` runs on the training thread: error feedback and the meter's records (what the exchange
will send is known before it is sent), and sparse's encoding; fp16, int8 and lowrank encode in
the collective part, which needs the mean to feed back its rounding. It returns that part as a
function of no arguments, which the caller runs at once or on a background thread
(`diloco.sync_delay`): that part uses only the column's side channel (the traffic layer's
`side_*` collectives) and this exchange's own state for the fragment, so it runs beside the
group's collectives on the training thread.
`transfers()` is the same accounting for the cost model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import numpy as np
import torch

from hvd_lowcomm.comm.half_wire import from_half_rows, to_half_rows
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.runtime import Group
from hvd_lowcomm.comm.traffic import FLOAT_BYTES, meter, side_allgather, side_allreduce_sum_, side_alltoall, wire_bytes
from hvd_lowcomm.methods.powersgd import orthogonalise

COMPRESSIONS = ("none", "fp16", "int8", "int2", "sparse", "lowrank")
BLOCK = 256  # numbers per int8 scale: one fp32 scale costs 1/64 of the block's bytes
# numbers per 4-bit scale: 4-bit factors of a pseudo-gradient's weak directions need a scale of
# their own more often (1/8 of the block's bytes)
BLOCK4 = 64
CHUNK = 4096  # numbers per sparse chunk: every chunk sends its own top-k
# Sparse beyond 2 groups, by default: the share of the groups' mean an owner sends back, as a multiple
# of a group's density (diloco.owner_density)
OWNER_DENSITY_SHARE = 3.0
MIN_COMPRESSION = 2.0  # a block is compressed only if (rows + cols)·rank·this < rows·cols (PowerSGD's)


@dataclass(frozen=True)
class Transfer:
    """One collective of an exchange: `payload` is what this rank hands it (an alltoall's whole
    send buffer; an allgather's own part, every member's being equal)."""

    op: str
    payload: int

    def sent_bytes(self, members: int) -> float:
        if self.op == "allgather":
            return wire_bytes("allgather", self.payload * members, members)
        return wire_bytes(self.op, self.payload, members)


Collective = Callable[[], torch.Tensor]
Encode = Callable[[torch.Tensor], torch.Tensor]  # a chunk of numbers -> bytes
Decode = Callable[[torch.Tensor, int], torch.Tensor]  # bytes, how many numbers -> the numbers
Encoded = TypeVar("Encoded")  # what an encoder makes of a chunk: its bytes, or (bytes, what they decode to)


@dataclass(frozen=True)
class Means:
    """A reduce-scatter's result for one part: the `mean` every member got, what this member's
    own chunks carried after rounding (`sent`), and `owner_lost`: G times what rounding the mean
    took from the chunk this member owns (zero elsewhere). Fed back into this member's error, a
    later exchange's mean (a sum over G members divided by G) returns it: nothing that rounding
    takes is lost, which in 4 bits is several % of a factor."""

    mean: torch.Tensor
    sent: torch.Tensor
    owner_lost: torch.Tensor


class Exchange:
    """The mean over the column of each fragment's pseudo-gradient slice (see the module)."""

    name = "none"

    def __init__(self, column: Group | None, options: Any, members: int | None = None) -> None:
        self.column, self.options = column, options
        # `members` without a column: the cost model's accounting for a column of that size
        self.members = column.size if column is not None else (members or 1)
        self.errors: dict[int, torch.Tensor] = {}  # error feedback per fragment
        self.owner_errors: dict[int, torch.Tensor] = {}  # per fragment: what encoding the mean part it owns left out

    # -- what subclasses define -----------------------------------------------------------------
    def transfers(self, numbers: int, shapes: list[tuple[int, ...]], start: int) -> list[Transfer]:
        """The collectives of one exchange of a slice of `numbers` (starting at `start` of its
        fragment, whose tensors have `shapes`)."""
        return [Transfer("allreduce", FLOAT_BYTES * numbers)]

    def start(self, fragment: int, delta: torch.Tensor, shapes: list[tuple[int, ...]], start: int) -> Collective:
        summed = delta.detach().cpu().clone()
        self._record(fragment, self.transfers(len(delta), shapes, start))
        return lambda: side_allreduce_sum_(summed, self.column).div_(self.members).to(delta.device)

    def take_unsent(self, fragment: int, share: float = 1.0) -> torch.Tensor | None:
        """`share` of this member's error feedback for the fragment, handed over and taken out of
        it: what its exchanges have not sent yet, for the caller to keep on its model instead (the
        next Δ, measured from the global parameters, then carries it)."""
        error = self.errors.pop(fragment, None)
        if error is not None and share < 1:
            self.errors[fragment] = (1 - share) * error
            return share * error
        return error

    # -- shared ---------------------------------------------------------------------------------
    def _record(self, fragment: int, transfers: list[Transfer]) -> None:
        for t in transfers:
            meter.record(
                t.op,
                f"diloco.outer.{fragment}.{self.name}.{t.op}",
                t.payload,
                self.column,
                wire=t.sent_bytes(self.members),
            )

    def _feedback(self, fragment: int, delta: torch.Tensor, decay: float = 1.0) -> torch.Tensor:
        """Δ plus (decay times) what earlier exchanges of this fragment left out."""
        error = self.errors.get(fragment)
        return delta.detach().cpu().clone() if error is None else decay * error + delta.detach().cpu()

    def _owners_encode(
        self, fragment: int, encode: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    ) -> Encode:
        """Encoding of the mean part this member owns, with its own error feedback: `encode` gives
        (bytes, what they decode to), and what it left out joins the next exchange's part. (Fed
        back G times into the owner's own error instead, as lowrank does, a coarse rounding of
        the mean is multiplied before the next one rounds it again, and more waits.)"""

        def owners(mean: torch.Tensor) -> torch.Tensor:
            pending = mean + self.owner_errors.get(fragment, torch.zeros_like(mean))
            payload, kept = encode(pending)
            self.owner_errors[fragment] = pending - kept
            return payload

        return owners

    def _encode_chunks(
        self, values: torch.Tensor, encode: Callable[[torch.Tensor], Encoded]
    ) -> tuple[list[Encoded], int]:
        """`values` cut into one chunk per column member (the last padded with zeros), each
        encoded, and the chunk length."""
        chunk = -(-len(values) // self.members)
        padded = torch.cat([values, values.new_zeros(chunk * self.members - len(values))])
        return [encode(c) for c in padded.view(self.members, chunk)], chunk

    def _reduce_scatter_transfers(self, parts: list[tuple[int, "Codec"]]) -> list[Transfer]:
        """What one reduce-scatter of `parts` (numbers, format) sends: every member's chunk of
        each part by alltoall, then each member's mean chunk by allgather."""
        each = sum(codec.size(-(-n // self.members)) for n, codec in parts)
        return [Transfer("alltoall", self.members * each), Transfer("allgather", each)]

    def _reduce_scatter_mean(
        self,
        payload: torch.Tensor,
        chunk: int,
        numbers: int,
        encode: Encode,
        decode: Decode,
        decode_mean: Decode | None = None,
    ) -> torch.Tensor:
        """The column's mean of the vectors whose encoded chunks (`_encode_chunks`, joined) are
        `payload`: member j receives every member's chunk j (alltoall), sums them in fp32 and
        returns its mean chunk encoded (allgather; `decode_mean` reads those, when `encode`
        differs from the first encoding)."""
        mean = torch.stack([decode(p, chunk) for p in side_alltoall(payload, self.column)]).sum(0) / self.members
        means = side_allgather(encode(mean), self.column)
        return torch.cat([(decode_mean or decode)(p, chunk) for p in means])[:numbers]

    def _means(self, parts: list[tuple[torch.Tensor, Codec]]) -> list[Means]:
        """The column's mean of each of `parts` in one reduce-scatter (chunks in the part's
        number format reduced in fp32; each part on blocks of its own, so that
        a bias never shares a scale with a factor's numbers), with what rounding took from it:
        this member's own chunks' and, on the chunk it owns, the mean's (see `Means`). An empty
        part sends nothing."""
        cut = [(self._encode_chunks(v, codec.encode), codec) for v, codec in parts]
        sizes = [codec.size(chunk) for (_, chunk), codec in cut]
        payload = torch.cat([encoded[j] for j in range(self.members) for (encoded, _), _ in cut])
        received = [p.split(sizes) for p in side_alltoall(payload, self.column)]  # every member's chunk j of each part
        means = [
            sum(codec.decode(r[i], chunk) for r in received) / self.members for i, ((_, chunk), codec) in enumerate(cut)
        ]
        mine = [codec.encode(m) for m, (_, codec) in zip(means, cut)]
        gathered = [g.split(sizes) for g in side_allgather(torch.cat(mine), self.column)]
        owned = self.column.rank_of(runtime.rank()) if self.members > 1 else 0
        out = []
        for i, ((v, _), ((encoded, chunk), codec)) in enumerate(zip(parts, cut)):
            lost = torch.zeros(chunk * self.members)
            lost[owned * chunk : (owned + 1) * chunk] = means[i] - codec.decode(mine[i], chunk)
            out.append(
                Means(
                    torch.cat([codec.decode(g[i], chunk) for g in gathered])[: len(v)],
                    torch.cat([codec.decode(e, chunk) for e in encoded])[: len(v)],
                    self.members * lost[: len(v)],
                )
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "errors": {f: e.clone() for f, e in self.errors.items()},
            "owner_errors": {f: e.clone() for f, e in self.owner_errors.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.errors = {int(f): e.clone() for f, e in state["errors"].items()}
        # (a checkpoint from before owners kept their own error has none: nothing pending)
        self.owner_errors = {int(f): e.clone() for f, e in state.get("owner_errors", {}).items()}


# ---------------------------------------------------------------------------------------------
# quantised reduce-scatter


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
    blocks = math.ceil(len(chunk) / BLOCK4)
    scales = torch.cat([chunk.abs(), chunk.new_zeros(blocks * BLOCK4 - len(chunk))]).view(blocks, BLOCK4).amax(1)
    levels = torch.repeat_interleave(scales, BLOCK4)[: len(chunk)]
    unit = torch.where(levels > 0, chunk / levels.clamp_min(torch.finfo(torch.float32).tiny), 0)
    codes = torch.round((unit + 1) * 1.5).clamp(0, 3).to(torch.uint8)  # [-1, 1] -> {0, 1, 2, 3}
    return torch.cat([pack_bits(codes.view(1, -1), 2).view(-1), scales.view(torch.uint8)])


def int2_decode(payload: torch.Tensor, numbers: int) -> torch.Tensor:
    packed = -(-numbers // 4)
    codes = unpack_bits(payload[:packed].view(1, -1), numbers, 2).view(-1)
    levels = torch.repeat_interleave(_view(payload[packed:], torch.float32), BLOCK4)[:numbers]
    return (codes.float() / 1.5 - 1) * levels


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


class Quantised(Exchange):
    """fp16, int8 or int2, reduce-scatter in fp32 and allgather (see the module)."""

    def __init__(self, column: Group | None, options: Any, members: int | None, kind: str) -> None:
        super().__init__(column, options, members)
        self.name, self.codec = kind, QUANTISED_CODECS[kind]

    def transfers(self, numbers: int, shapes: list[tuple[int, ...]], start: int) -> list[Transfer]:
        return self._reduce_scatter_transfers([(numbers, self.codec)])

    def start(self, fragment: int, delta: torch.Tensor, shapes: list[tuple[int, ...]], start: int) -> Collective:
        corrected = self._feedback(fragment, delta)
        self._record(fragment, self.transfers(len(corrected), shapes, start))
        codec = self.codec

        def encoded_and_kept(mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            payload = codec.encode(mean)
            return payload, codec.decode(payload, len(mean))

        def collective() -> torch.Tensor:
            encoded, chunk = self._encode_chunks(corrected, codec.encode)
            owners = codec.encode
            if self.name != "fp16":  # fp16's rounding is far below the signal; both of the others' are fed back
                sent = torch.cat([codec.decode(e, chunk) for e in encoded])[: len(corrected)]
                self.errors[fragment] = corrected - sent
                owners = self._owners_encode(fragment, encoded_and_kept)
            mean = self._reduce_scatter_mean(torch.cat(encoded), chunk, len(corrected), owners, codec.decode)
            return mean.to(delta.device)

        return collective


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
# high_i + i of a k + u/2^low bit vector is set for the i-th offset. At the default density
# that is under half the bits of 12-bit offsets.


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
    bits = (values.unsqueeze(-1) >> torch.arange(width)) & 1
    return _pack_rows(bits.reshape(len(values), -1))


def unpack_bits(packed: torch.Tensor, count: int, width: int) -> torch.Tensor:
    bits = _unpack_rows(packed, count * width).view(len(packed), count, width).long()
    return (bits << torch.arange(width)).sum(-1)


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
    kept = levels.gather(1, codes & 1) * (1 - 2 * (codes >> 1).float())
    out = torch.zeros(chunks, chunk).scatter_(1, offsets, kept)
    return out.view(-1)[:numbers]


def _view(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes of a received payload as `dtype` (copied: a part of a gathered buffer may start at
    an offset the wider type cannot view)."""
    return payload.clone().view(dtype)


def _mean_where(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row, the mean of `values` where `mask` holds (0 where it never does)."""
    return (values * mask).sum(1) / mask.sum(1).clamp(min=1)


class Sparse(Exchange):
    """Chunked top-k at 2 bits: allgathered at 2 groups, reduced by owner beyond (see the module)."""

    name = "sparse"

    def __init__(self, column: Group | None, options: Any, members: int | None = None) -> None:
        super().__init__(column, options, members)
        # At 2 groups a reduce-scatter sends what an allgather does, (G-1) slices' sparse bytes, and
        # its second selection only loses; beyond, it sends (G-1)/G of them at density and (G-1)/G
        # at owner_density (under four slices' worth at the default owner_density) where an allgather sends G-1.
        self.by_owner = self.members > 2
        self.owner_density = options.owner_density or min(1.0, OWNER_DENSITY_SHARE * options.density)

    def transfers(self, numbers: int, shapes: list[tuple[int, ...]], start: int) -> list[Transfer]:
        if not self.by_owner:
            return [Transfer("allgather", sparse_bytes(numbers, self.options.density))]
        part = -(-numbers // self.members)
        return [
            Transfer("alltoall", self.members * sparse_bytes(part, self.options.density)),
            Transfer("allgather", sparse_bytes(part, self.owner_density)),
        ]

    def start(self, fragment: int, delta: torch.Tensor, shapes: list[tuple[int, ...]], start: int) -> Collective:
        density = self.options.density
        accumulated = self._feedback(fragment, delta, self.options.error_decay)
        if self.by_owner:
            pairs, part = self._encode_chunks(accumulated, lambda c: sparse_encode(c, density))
            payload = torch.cat([bytes_ for bytes_, _ in pairs])
            sent = torch.cat([kept for _, kept in pairs])[: len(accumulated)]
        else:
            payload, sent = sparse_encode(accumulated, density)
        self.errors[fragment] = accumulated - sent
        transfers = self.transfers(len(delta), shapes, start)
        assert len(payload) == transfers[0].payload, "the meter must count what is sent"
        self._record(fragment, transfers)

        def decode(p: torch.Tensor, numbers: int) -> torch.Tensor:
            return sparse_decode(p, numbers, density)

        # the mean part this member owns goes sparse again at owner_density (the groups' supports
        # differ, so the mean holds up to G times the kept numbers)
        owners_top = self._owners_encode(fragment, lambda mean: sparse_encode(mean, self.owner_density))

        def collective() -> torch.Tensor:
            if self.by_owner:
                mean = self._reduce_scatter_mean(
                    payload,
                    part,
                    len(delta),
                    owners_top,
                    decode,
                    lambda p, numbers: sparse_decode(p, numbers, self.owner_density),
                )
            else:
                gathered = side_allgather(payload, self.column)
                mean = torch.stack([decode(p, len(delta)) for p in gathered]).sum(0).div_(self.members)
            return mean.to(delta.device)

        return collective


# ---------------------------------------------------------------------------------------------
# low rank: PowerSGD on each whole-row block of the slice


@dataclass(frozen=True)
class Pieces:
    """How a slice splits: `matrices` (offset in the slice, rows, columns, rank) compressed,
    `dense` (offset, length) sent as they are."""

    matrices: tuple[tuple[int, int, int, int], ...]
    dense: tuple[tuple[int, int], ...]


def slice_pieces(
    shapes: list[tuple[int, ...]],
    start: int,
    numbers: int,
    rank: int,
    share: float,
    factor_bytes: float = INT4.per_number,
) -> Pieces:
    """The whole-row blocks of each tensor inside [start, start + numbers) of the fragment's
    flat numbers, as matrices where a low rank pays, and the rest as dense runs.

    Each matrix's rank is `rank`, or with rank 0 what its part of the byte budget buys: the
    slice may send `share` of its fp32 bytes (scales included); the dense runs take their int8
    bytes first, and each matrix gets the rest, at `factor_bytes` a factor's number, in
    proportion to its size, so every matrix is compressed by the same factor. A fixed rank
    spends that budget unevenly: rank 8 in int8 sent 1/39 of a GPT's fp32 bytes (128-wide
    matrices) and 1/34-1/68 of an MLP's (256-1024 wide)."""
    blocks, dense, offset, stop = [], [], 0, start + numbers
    for shape in shapes:
        size = math.prod(shape)
        lo, hi = max(offset, start), min(offset + size, stop)
        if lo < hi:
            cols = size // shape[0] if len(shape) > 1 else size
            first, last = -(-(lo - offset) // cols), (hi - offset) // cols  # whole rows inside
            rows = last - first
            if len(shape) > 1 and rows > 0 and _pays(rows, cols, 1):
                a, b = offset + first * cols, offset + last * cols
                blocks.append((a - start, rows, cols))
                dense += [(lo - start, a - lo)] if a > lo else []
                dense += [(b - start, hi - b)] if hi > b else []
            else:
                dense.append((lo - start, hi - lo))
        offset += size
    area = sum(rows * cols for _, rows, cols in blocks)
    # the factors' numbers: the budget less the dense runs' int8 bytes, at factor_bytes each
    spare = (share * FLOAT_BYTES * numbers - INT8.per_number * sum(n for _, n in dense)) / factor_bytes
    matrices = []
    for o, rows, cols in blocks:
        r = min(rank, rows, cols) if rank else max(1, int(spare * rows * cols / area / (rows + cols)))
        if rank and not _pays(rows, cols, r):
            dense.append((o, rows * cols))
            continue
        while not _pays(rows, cols, r):  # a generous share: the rank stays where factors still pay
            r -= 1
        matrices.append((o, rows, cols, r))
    return Pieces(tuple(matrices), tuple(sorted(dense)))


def _pays(rows: int, cols: int, rank: int) -> bool:
    """Whether rank-`rank` factors are at least MIN_COMPRESSION times smaller than the matrix."""
    return (rows + cols) * rank * MIN_COMPRESSION < rows * cols


class LowRank(Exchange):
    name = "lowrank"

    def __init__(self, column: Group | None, options: Any, members: int | None, seed: int = 0) -> None:
        super().__init__(column, options, members)
        self.seed, self.factor = seed, FACTOR_CODECS[options.factor_bits]
        self.qs: dict[int, list[torch.Tensor]] = {}  # warm start per fragment, one Q per matrix

    def pieces(self, shapes: list[tuple[int, ...]], start: int, numbers: int) -> Pieces:
        """The slice's matrices and dense runs, with the budget's ranks brought within it on the
        wire: `slice_pieces` counts bytes a number, and what a member's chunks round up to (a
        scale per started block, a byte per odd nibble) could take a short slice past it."""
        pieces = slice_pieces(
            shapes, start, numbers, self.options.rank, self.options.factor_share, self.factor.per_number
        )
        if self.options.rank or self.members == 1:
            return pieces
        budget = self.options.factor_share * self._wire(Exchange.transfers(self, numbers, shapes, start))
        while self._wire(self._transfers(pieces)) > budget and any(r > 1 for *_, r in pieces.matrices):
            largest = max(range(len(pieces.matrices)), key=lambda i: pieces.matrices[i][3])
            o, rows, cols, r = pieces.matrices[largest]
            pieces = Pieces(
                pieces.matrices[:largest] + ((o, rows, cols, r - 1),) + pieces.matrices[largest + 1 :], pieces.dense
            )
        return pieces

    def _wire(self, transfers: list[Transfer]) -> float:
        return sum(t.sent_bytes(self.members) for t in transfers)

    def transfers(self, numbers: int, shapes: list[tuple[int, ...]], start: int) -> list[Transfer]:
        return self._transfers(self.pieces(shapes, start, numbers))

    def _transfers(self, pieces: Pieces) -> list[Transfer]:
        first = [
            (sum(rows * r for _, rows, _, r in pieces.matrices), self.factor),
            (sum(n for _, n in pieces.dense), INT8),
        ]
        second = [(sum(cols * r for _, _, cols, r in pieces.matrices), self.factor)]
        return self._reduce_scatter_transfers(first) + (
            self._reduce_scatter_transfers(second) if pieces.matrices else []
        )

    def _initial_qs(self, fragment: int, pieces: Pieces) -> list[torch.Tensor]:
        """Random orthonormal Qs, the same on every member of the column (same seed, same slice)."""
        generator = torch.Generator().manual_seed(self.seed * 1009 + fragment)
        return [orthogonalise(torch.randn(cols, r, generator=generator)) for _, _, cols, r in pieces.matrices]

    def start(self, fragment: int, delta: torch.Tensor, shapes: list[tuple[int, ...]], start: int) -> Collective:
        pieces = self.pieces(shapes, start, len(delta))
        corrected = self._feedback(fragment, delta)
        if fragment not in self.qs:
            self.qs[fragment] = self._initial_qs(fragment, pieces)
        self._record(fragment, self._transfers(pieces))

        def collective() -> torch.Tensor:
            ms = [corrected[o : o + rows * cols].view(rows, cols) for o, rows, cols, _ in pieces.matrices]
            qs = self.qs[fragment]
            # Factors travel column by column, each direction scaled near unit size by its warm
            # start (the same on every member): column i of M Q grows as σ_i times Q's column norm
            # (σ_i at the last exchange), and of Mᵀ P as σ_i, so unscaled the weak directions
            # would round to nothing beside the strong ones on a block's shared scale.
            # Scaling a column of P changes nothing once P is orthogonalised; Q's is undone.
            norms = [q.pow(2).sum(0).clamp_min(1e-30).sqrt() for q in qs]
            first, dense = self._means(
                [
                    (
                        torch.cat([((m @ q) / n**2).T.reshape(-1) for m, q, n in zip(ms, qs, norms)] + [corrected[:0]]),
                        self.factor,
                    ),
                    (torch.cat([corrected[o : o + n] for o, n in pieces.dense] + [corrected[:0]]), INT8),
                ]
            )
            out, error, at = torch.zeros_like(corrected), torch.zeros_like(corrected), 0
            for o, n in pieces.dense:
                out[o : o + n] = dense.mean[at : at + n]
                error[o : o + n] = corrected[o : o + n] - dense.sent[at : at + n] + dense.owner_lost[at : at + n]
                at += n
            ps, at = [], 0
            for m, q in zip(ms, qs):  # P's rounding does not matter: it is orthogonalised and used as it is
                ps.append(orthogonalise(first.mean[at : at + m.shape[0] * q.shape[1]].view(q.shape[1], m.shape[0]).T))
                at += m.shape[0] * q.shape[1]
            if not ms:  # no matrices: no second mean (`transfers` has none)
                self.errors[fragment] = error
                return out.to(delta.device)
            (second,) = self._means(
                [(torch.cat([((p.T @ m) / n[:, None]).reshape(-1) for m, p, n in zip(ms, ps, norms)]), self.factor)]
            )
            at, mean_qs = 0, []
            for (o, rows, cols, r), m, p, n in zip(pieces.matrices, ms, ps, norms):
                mean_q, sent_q, lost_q = (
                    (part[at : at + cols * r].view(r, cols) * n[:, None]).T
                    for part in (second.mean, second.sent, second.owner_lost)
                )
                at += cols * r
                out[o : o + rows * cols] = (p @ mean_q.T).reshape(-1)
                error[o : o + rows * cols] = (m - p @ (sent_q - lost_q).T).reshape(-1)
                mean_qs.append(mean_q.contiguous())
            self.errors[fragment], self.qs[fragment] = error, mean_qs  # warm start: the mean Q
            return out.to(delta.device)

        return collective

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "qs": {f: [q.clone() for q in qs] for f, qs in self.qs.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.qs = {int(f): [q.clone() for q in qs] for f, qs in state["qs"].items()}


def make_exchange(column: Group | None, options: Any, seed: int = 0, members: int | None = None) -> Exchange:
    """The exchange `options.compression` names (a DiLoCoOptions) over `column` (None and
    `members`: for accounting only)."""
    kind = options.compression
    if kind in QUANTISED_CODECS:
        return Quantised(column, options, members, kind)
    if kind == "sparse":
        return Sparse(column, options, members)
    if kind == "lowrank":
        return LowRank(column, options, members, seed)
    return Exchange(column, options, members)
