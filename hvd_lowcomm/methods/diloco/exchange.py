"""How groups combine their pseudo-gradients across the slow network: DiLoCo's column exchange
(the wire formats are hvd_lowcomm.comm.wire_codecs).

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
            `diloco.sparse.keep_unsent` (the default) DiLoCo takes a group's accumulator after each
            exchange (`take_unsent`; `diloco.sparse.unsent_share` of it) and keeps it on the group's
            model instead: Δ, measured from the global model, then carries it, and the group
            trains on from it meanwhile.
- lowrank (`LowRank`): PowerSGD on each matrix's pseudo-gradient (the seed's premise: an
            update is low-rank): P = M Q, mean, orthogonalise, Q = Mᵀ P, mean; error feedback and
            warm start of Q across syncs. A slice cuts matrices along rows, so each whole-row
            block of a tensor is a matrix; vectors and cut rows go dense. Each matrix's rank
            is what its part of a byte budget buys (`diloco.lowrank.factor_share` of fp32's bytes, every
            matrix compressed alike), or one fixed `diloco.lowrank.rank`. Both means are reduce-
            scatters as above, the factors in 4 bits (`diloco.lowrank.factor_bits`; 64 numbers to a
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

import torch

from hvd_lowcomm.comm.runtime import Group
from hvd_lowcomm.comm.traffic import (
    FLOAT_BYTES,
    meter,
    position_in,
    side_allgather,
    side_allreduce_sum_,
    side_alltoall,
    wire_bytes,
)
from hvd_lowcomm.comm.wire_codecs import (
    FACTOR_CODECS,
    INT4,
    INT8,
    QUANTISED_CODECS,
    Codec,
    Decode,
    Encode,
    sparse_bytes,
    sparse_decode,
    sparse_encode,
)
from hvd_lowcomm.methods.powersgd.algorithm import orthogonalise

COMPRESSIONS = ("none", "fp16", "int8", "int2", "sparse", "lowrank")
# Sparse beyond 2 groups, by default: the share of the groups' mean an owner sends back, as a multiple
# of a group's density (diloco.sparse.owner_density)
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
    feeds_back = False  # whether it keeps an error-feedback buffer the size of its slice

    def __init__(self, column: Group | None, options: Any, members: int | None = None) -> None:
        self.column, self.options = column, options
        # `members` without a column: the cost model's accounting for a column of that size
        self.members = column.size if column is not None else (members or 1)
        self.errors: dict[int, torch.Tensor] = {}  # error feedback per fragment
        self.owner_errors: dict[int, torch.Tensor] = {}  # per fragment: what encoding the mean part it owns left out
        self.owner_layouts: dict[int, tuple[int, int]] = {}  # per fragment: (members, position) they were cut for
        # False for a trial exchange (an evaluation's sync), whose state is put back after: the
        # quantised forms then make no new error feedback
        self.keeping = True

    # -- what subclasses define -----------------------------------------------------------------
    def transfers(self, numbers: int, shapes: list[tuple[int, ...]], start: int) -> list[Transfer]:
        """The collectives of one exchange of a slice of `numbers` (starting at `start` of its
        fragment, whose tensors have `shapes`)."""
        return [Transfer("allreduce", FLOAT_BYTES * numbers)]

    def start(self, fragment: int, delta: torch.Tensor, shapes: list[tuple[int, ...]], start: int) -> Collective:
        """Start the exchange of `delta`, this rank's slice of the fragment's pseudo-gradient
        (starting at `start` of the fragment, whose tensors have `shapes`): the exchange's own
        from here, written into and reused for the mean (a caller that keeps Δ passes a copy).
        Returns the collective part, which gives the mean."""
        summed, device = delta.detach().cpu(), delta.device
        self._record(fragment, self.transfers(len(delta), shapes, start))
        return lambda: side_allreduce_sum_(summed, self.column).div_(self.members).to(device)

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
        """Δ plus (decay times) what earlier exchanges of this fragment left out, which it takes
        out of the error feedback (the exchange puts back what it leaves out in turn)."""
        error = self.errors.pop(fragment, None)
        delta = delta.detach().cpu()  # the exchange's own (see start): added to in place
        return delta if error is None else delta.add_(error if decay == 1 else decay * error)

    def _owner_part(
        self,
        before: torch.Tensor | None,
        into: torch.Tensor | None,
        at: int,
        encode: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> Encode:
        """Encoding of a mean chunk this member owns, with its own error feedback: `encode`
        gives (bytes, what they decode to); the last exchange's feedback (`before`, from `at`
        on) is added first, and what this encoding leaves out goes `into` the next one's, if
        any. (Fed back G times into the owner's own error instead, as lowrank does, a coarse
        rounding of the mean is multiplied before the next one rounds it again, and more waits.)"""

        def owners(mean: torch.Tensor) -> torch.Tensor:  # mean: the caller's, added to in place
            pending = mean if before is None else mean.add_(before[at : at + len(mean)])
            payload, kept = encode(pending)
            if into is not None:
                torch.sub(pending, kept, out=into)
            return payload

        return owners

    def _owned_before(self, fragment: int) -> torch.Tensor | None:
        """This member's error feedback on the mean chunks it owns, taken out; None where the
        column's members changed since (elastic groups): the chunks are cut anew, and what the
        old owners held back restarts at zero, as a departed member's own error feedback does."""
        layout = (self.members, position_in(self.column) if self.members > 1 else 0)
        before = self.owner_errors.pop(fragment, None)
        if self.owner_layouts.get(fragment, layout) != layout:  # none recorded (a checkpoint's): as cut
            before = None
        self.owner_layouts[fragment] = layout
        return before

    def _encode_chunks(
        self, values: torch.Tensor, encode: Callable[[torch.Tensor], Encoded]
    ) -> tuple[list[Encoded], int]:
        """`values` cut into one chunk per column member (the last padded with zeros), each
        encoded, and the chunk length."""
        chunk = -(-len(values) // self.members)
        pieces = [values[j * chunk : (j + 1) * chunk] for j in range(self.members)]  # views: no copy of the slice
        return [encode(torch.cat([c, c.new_zeros(chunk - len(c))]) if len(c) < chunk else c) for c in pieces], chunk

    def _reduce_scatter_transfers(self, parts: list[tuple[int, "Codec"]]) -> list[Transfer]:
        """What one reduce-scatter of `parts` (numbers, format) sends: every member's chunk of
        each part by alltoall, then each member's mean chunk by allgather."""
        each = sum(codec.size(-(-n // self.members)) for n, codec in parts)
        return [Transfer("alltoall", self.members * each), Transfer("allgather", each)]

    def _reduce_scatter_mean(
        self,
        payload: torch.Tensor,
        chunk: int,
        out: torch.Tensor,
        encode: Encode,
        decode: Decode,
        decode_mean: Decode | None = None,
    ) -> torch.Tensor:
        """The column's mean of the vectors whose encoded chunks (`_encode_chunks`, joined) are
        `payload`, written into `out` (as long as each vector): member j receives every member's
        chunk j (alltoall), sums them in fp32 and returns its mean chunk encoded (allgather;
        `decode_mean` reads those, when `encode` differs from the first encoding)."""
        mean = torch.zeros(chunk)
        for p in side_alltoall(payload, self.column):  # summed one at a time: no stack of every member's chunk
            mean += decode(p, chunk)
        means = side_allgather(encode(mean.div_(self.members)), self.column)
        return decode_chunks(means, chunk, out, decode_mean or decode)

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
        owned = position_in(self.column) if self.members > 1 else 0
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

    # Each exchange replaces these dicts' tensors and never writes into them, so a trial exchange
    # (an evaluation's sync) is undone by putting the old references back, with no copy of a slice.
    kept_state = ("errors", "owner_errors", "owner_layouts")

    def kept(self) -> dict[str, dict[int, Any]]:
        """This exchange's state as it is now, by reference (see kept_state), for `put_back`."""
        return {name: dict(getattr(self, name)) for name in self.kept_state}

    def put_back(self, kept: dict[str, dict[int, Any]]) -> None:
        for name, value in kept.items():
            setattr(self, name, dict(value))

    def state_dict(self) -> dict[str, Any]:
        """The error feedback, by reference (see kept_state: no exchange writes into it)."""
        return {"errors": dict(self.errors), "owner_errors": dict(self.owner_errors)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.errors = {int(f): e for f, e in state["errors"].items()}
        # (a checkpoint from before owners kept their own error has none: nothing pending)
        self.owner_errors = {int(f): e for f, e in state.get("owner_errors", {}).items()}


class Quantised(Exchange):
    """fp16, int8 or int2, reduce-scatter in fp32 and allgather (see the module), a piece of
    at most `piece` numbers of the slice at a time."""

    # numbers reduced at once: the exchange's temporaries stay this size whatever the slice's,
    # for sharded groups of a model that barely fits (a smaller slice is one piece)
    piece = 1 << 24

    def __init__(self, column: Group | None, options: Any, members: int | None, kind: str) -> None:
        super().__init__(column, options, members)
        self.name, self.codec = kind, QUANTISED_CODECS[kind]
        self.feeds_back = kind != "fp16"  # fp16's rounding is far below the signal

    def _encoded_and_kept(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        payload = self.codec.encode(values)
        return payload, self.codec.decode(payload, len(values))

    def _pieces(self, numbers: int) -> list[tuple[int, int]]:
        return [(a, min(a + self.piece, numbers)) for a in range(0, max(numbers, 1), self.piece)]

    def transfers(self, numbers: int, shapes: list[tuple[int, ...]], start: int) -> list[Transfer]:
        # each piece's collectives, counted as one of each (the bytes are what every piece sends)
        return self._reduce_scatter_transfers([(b - a, self.codec) for a, b in self._pieces(numbers)])

    def start(self, fragment: int, delta: torch.Tensor, shapes: list[tuple[int, ...]], start: int) -> Collective:
        corrected, device = self._feedback(fragment, delta), delta.device
        self._record(fragment, self.transfers(len(corrected), shapes, start))
        held = [corrected]  # handed to the collective, which writes the mean over it
        keeps = self.feeds_back and self.keeping

        def collective() -> torch.Tensor:
            corrected = held.pop()
            pieces = self._pieces(len(corrected))
            chunks = [-(-(b - a) // self.members) for a, b in pieces]
            owned_before = self._owned_before(fragment) if self.feeds_back else None  # per piece, its chunk
            errors = torch.empty_like(corrected) if keeps else None
            owned = torch.empty(sum(chunks)) if keeps else None
            at = 0
            for (a, b), chunk in zip(pieces, chunks):
                part = corrected[a:b]
                encoded, _ = self._encode_chunks(part, self.codec.encode)
                owners = self.codec.encode
                if keeps:
                    sent = decode_chunks(encoded, chunk, errors[a:b], self.codec.decode)
                    torch.sub(part, sent, out=sent)
                if self.feeds_back:
                    into = None if owned is None else owned[at : at + chunk]
                    owners = self._owner_part(owned_before, into, at, self._encoded_and_kept)
                    at += chunk
                # the mean over Δ's memory: this piece of Δ is encoded and fed back by now
                self._reduce_scatter_mean(torch.cat(encoded), chunk, part, owners, self.codec.decode)
            if keeps:
                self.errors[fragment], self.owner_errors[fragment] = errors, owned
            return corrected.to(device)

        return collective


def decode_chunks(payloads: list[torch.Tensor], chunk: int, out: torch.Tensor, decode: Decode) -> torch.Tensor:
    """Chunk j of `out` (the last one cut to out's end) decoded from payloads[j], one at a time:
    no list of decoded chunks beside their concatenation."""
    for j, p in enumerate(payloads):
        part = out[j * chunk : (j + 1) * chunk]
        part.copy_(decode(p, chunk)[: len(part)])
    return out


# ---------------------------------------------------------------------------------------------
# sparse: chunked top-k at 2 bits with an error-feedback accumulator


class Sparse(Exchange):
    """Chunked top-k at 2 bits: allgathered at 2 groups, reduced by owner beyond (see the module)."""

    name = "sparse"
    feeds_back = True

    def __init__(self, column: Group | None, options: Any, members: int | None = None) -> None:
        super().__init__(column, options, members)
        # At 2 groups a reduce-scatter sends what an allgather does, (G-1) slices' sparse bytes, and
        # its second selection only loses; beyond, it sends (G-1)/G of them at density and (G-1)/G
        # at owner_density (under four slices' worth at the default owner_density) where an allgather sends G-1.
        self.by_owner = self.members > 2
        self.owner_density = options.sparse.owner_density or min(1.0, OWNER_DENSITY_SHARE * options.sparse.density)

    def transfers(self, numbers: int, shapes: list[tuple[int, ...]], start: int) -> list[Transfer]:
        if not self.by_owner:
            return [Transfer("allgather", sparse_bytes(numbers, self.options.sparse.density))]
        part = -(-numbers // self.members)
        return [
            Transfer("alltoall", self.members * sparse_bytes(part, self.options.sparse.density)),
            Transfer("allgather", sparse_bytes(part, self.owner_density)),
        ]

    def start(self, fragment: int, delta: torch.Tensor, shapes: list[tuple[int, ...]], start: int) -> Collective:
        density = self.options.sparse.density
        accumulated = self._feedback(fragment, delta, self.options.sparse.error_decay)
        numbers, device = len(delta), delta.device
        if self.by_owner:
            pairs, part = self._encode_chunks(accumulated, lambda c: sparse_encode(c, density))
            payload = torch.cat([bytes_ for bytes_, _ in pairs])
            sent = torch.cat([kept for _, kept in pairs])[: len(accumulated)]
        else:
            payload, sent = sparse_encode(accumulated, density)
        self.errors[fragment] = torch.sub(accumulated, sent, out=sent)  # into sent's memory
        transfers = self.transfers(len(delta), shapes, start)
        assert len(payload) == transfers[0].payload, "the meter must count what is sent"
        self._record(fragment, transfers)

        def decode(p: torch.Tensor, numbers: int) -> torch.Tensor:
            return sparse_decode(p, numbers, density)

        def collective() -> torch.Tensor:
            if self.by_owner:
                # the mean part this member owns goes sparse again at owner_density (the groups'
                # supports differ, so the mean holds up to G times the kept numbers)
                owned = torch.empty(part)
                top = self._owner_part(
                    self._owned_before(fragment), owned, 0, lambda mean: sparse_encode(mean, self.owner_density)
                )
                mean = self._reduce_scatter_mean(
                    payload,
                    part,
                    torch.empty(numbers),
                    top,
                    decode,
                    lambda p, numbers: sparse_decode(p, numbers, self.owner_density),
                )
                self.owner_errors[fragment] = owned
            else:
                gathered = side_allgather(payload, self.column)
                mean = torch.stack([decode(p, numbers) for p in gathered]).sum(0).div_(self.members)
            return mean.to(device)

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
    proportion to its size, so every matrix is compressed by the same factor (a fixed rank
    would compress narrow matrices less than wide ones; docs: diloco)."""
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
    feeds_back = True
    kept_state = (*Exchange.kept_state, "qs")

    def __init__(self, column: Group | None, options: Any, members: int | None, seed: int = 0) -> None:
        super().__init__(column, options, members)
        self.seed, self.factor = seed, FACTOR_CODECS[options.lowrank.factor_bits]
        self.qs: dict[int, list[torch.Tensor]] = {}  # warm start per fragment, one Q per matrix

    def pieces(self, shapes: list[tuple[int, ...]], start: int, numbers: int) -> Pieces:
        """The slice's matrices and dense runs, with the budget's ranks brought within it on the
        wire: `slice_pieces` counts bytes a number, and what a member's chunks round up to (a
        scale per started block, a byte per odd nibble) could take a short slice past it."""
        pieces = slice_pieces(
            shapes, start, numbers, self.options.lowrank.rank, self.options.lowrank.factor_share, self.factor.per_number
        )
        if self.options.lowrank.rank or self.members == 1:
            return pieces
        budget = self.options.lowrank.factor_share * self._wire(Exchange.transfers(self, numbers, shapes, start))
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
        corrected, device = self._feedback(fragment, delta), delta.device
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
                return out.to(device)
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
            return out.to(device)

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
