r"""Document-aware placement: long documents cut across every rank, short ones whole on one rank.

Cutting every packed document into 2W chunks (the per-document layouts of ``zigzag.py`` and
``stripe.py``) gives the kernels pieces far below their tile: a 128-token document becomes eight
16-token chunks at W = 4, each a kernel segment that costs a whole 128-row tile. A document too
short to give every chunk a tile is better kept whole, on one rank, attended there at step 0 and
sent nowhere. The rule, a function of the boundaries, W and the local length alone, so that every
consumer derives the same placement (``shard_sequence``, ``ContextParallel``, each rank's schedule,
with the boundaries on the host or only as a tensor in a traced graph):

* A document is **long** if it has at least ``cut_length(W, S_local)`` tokens. The documents up to
  the last long one, in row order, are **cut**: the layout applies to each as before (zigzag: 2W
  chunks, rank r holds chunks r and 2W-1-r; stripe: tokens r, r+W, ...). They form the *long
  stream*; every rank holds L = (their tokens) / W of it, its first L local rows, in the layout's
  per-document form.
* The documents after the last long one are **short**: in row order they fill the ranks' last
  C = S_local - L rows one rank after another (the *short stream*: rank r holds [rC, (r+1)C)).
* The short documents must each lie within one rank's C tokens, and every rank's causal work (the
  (q, k) pairs its rows attend: its share of each cut document, n(n+1)/2W, plus n(n+1)/2 of each
  short document it holds) must lie within ``BALANCE`` of the mean. If not, every document is cut
  (the per-document layout of the layout's file, as without placement).

``dr.pad_documents(..., world_size=W)`` arranges a batch so that the rule holds (``plan_row``): it
chooses which documents to cut (the long ones, and short ones where the others cannot be balanced
without them), puts them first, balances the short ones over the ranks (largest first onto the
least-loaded rank with room), puts each rank's group after them in rank order and pads each group
to C tokens (and each cut document to a multiple of 2W). Rows arranged otherwise still work: the
rule then usually cuts every document, as before.

Rank r's local rows, W = 2, one cut document c (zigzag: chunks c0..c3) and short ones s1..s4:

    row:      c0 c1 c2 c3 | s1 s1 s2 | s3 s3 s3           rank 0: c0 c3 | s1 s1 s2
                                                          rank 1: c1 c2 | s3 s3 s3

Blocks (the ring's; llama3 gathers the long part the same way): step 0 attends the rank's own
K/V in one varlen block: the long part causal per cut document (the layout's own segments), then
each short document causal; steps src != rank attend the long part only, as the layout's
per-document grid. The K/V exchanged are the long part's L rows: a short document's keys are
needed by no other rank.

The threshold (measured: docs/design.md, "Measurements behind design choices"): a varlen
kernel costs about one tile of 128 q rows x 128 keys per tile pair it touches, full or not.
Cutting a document of n = 2W c tokens costs each rank 2W x^2 + x tile pairs for x = c / 128 >= 1,
what the whole document costs on one rank (m (m + 1) / 2 for m = n / 128 tiles): no loss in the
kernels once a chunk is a tile, and measured so. But a cut document's K/V travel to every rank
and its dK/dV back; a whole one's go nowhere. So a document stays whole up to half a rank's
tokens (``cut_length``: a whole document's work must stay small beside a rank's share for the
ranks to balance), and ``plan_row`` cuts a shorter one only where the ranks' work would not
balance otherwise. A cut document's chunks then hold S_local / 4W rows or more: a tile or more
from S_local = 512 W.

Host and traced forms: with the boundaries' values on the host (CPU ``cu_seqlens``, or the
documents ``ContextParallel`` found) the placement is exact: the long part is a slice of L rows,
the messages hold L rows and each block lists only its own documents. In a traced graph (the
compile pass, CUDA graph capture) the values are unknown, so shapes are the static ones: every
block spans all local rows, with the rows outside its documents in segments that see no keys
("inert"), the messages hold every row, and the per-document tensors keep one entry per document.
Both forms give the same results.
"""
import torch

from .blocks import Block, Segments
from .boundaries import Documents

TILE_ROWS = 128  # the varlen kernels' q tile (flash varlen, cuDNN and the Triton kernels: 128)
BALANCE = 0.03  # the largest deviation of a rank's causal work from the mean that the rule takes
# The padding ``plan_row`` adds to give a short document room before it cuts the document instead
# (a fraction of the row): padding costs the whole model's compute on it, a cut short document
# its chunks' kernel segments in every ring step.
PADDING_BUDGET = 0.02


def cut_length(world: int, local_len: int) -> int:
    """The length from which a document is cut: half a rank's tokens (the module docstring), a
    multiple of 2W, at least 2W."""
    unit = 2 * world
    return unit * max(1, local_len // (2 * unit))


def cut_documents(cu: torch.Tensor, world: int, local_len: int) -> torch.Tensor:
    """Which documents the rule of the module docstring cuts (bool, [N]), from the boundaries
    ``cu`` (an int tensor [N + 1], on any device; tensor ops only, so a traced graph computes it
    too)."""
    cu = cu.long()
    lengths = cu[1:] - cu[:-1]
    index = torch.arange(lengths.shape[0], device=cu.device)
    last_long = torch.where(lengths >= cut_length(world, local_len), index, -1).max()
    long_ = index <= last_long  # the documents up to the last long one
    short = torch.where(long_, 0, lengths)
    long_tokens = (lengths * long_).sum()
    part = (local_len - torch.div(long_tokens, world, rounding_mode="floor")).clamp_min(1)
    end = short.cumsum(0)
    start = end - short
    rank = torch.div(start, part, rounding_mode="floor")
    last = torch.div((end - 1).clamp_min(0), part, rounding_mode="floor")
    fits = ((short == 0) | (rank == last)).all() & (long_tokens % world == 0)
    work = short * (short + 1) // 2
    per_rank = torch.zeros(world, dtype=torch.long, device=cu.device).scatter_add_(
        0, rank.clamp(0, world - 1), work)
    long_work = (lengths * (lengths + 1) // 2 * long_).sum()
    total = long_work + work.sum()
    # |rank's work - mean| <= BALANCE x mean, in integers (x W x 100): no rounding, no overflow
    # below ~10^7 tokens
    deviation = (world * per_rank + long_work - total).abs()
    balanced = (100 * deviation <= round(100 * BALANCE) * total).all()
    return long_ | ~(fits & balanced)


def cut_documents_host(values: list[int], world: int, local_len: int) -> list[bool]:
    """``cut_documents`` of host boundaries, as Python bools."""
    return cut_documents(torch.tensor(values), world, local_len).tolist()


class Placement:
    """The placement of one call's documents (``boundaries.Documents``) on ``world`` ranks of
    ``local_len`` rows: what the layouts and schedules need, derived once per batch
    (``placement_of``). Tensors on the documents' device."""

    def __init__(self, docs, world: int, local_len: int):
        self.world, self.local_len, self.docs = world, local_len, docs
        self.known = docs.host is not None
        device = docs.cu.device
        # The rule on the host's values where they are known (no device work, no sync)
        cu = torch.tensor(docs.host) if self.known else docs.cu.long()
        cut = cut_documents(cu, world, local_len)
        lengths = cu[1:] - cu[:-1]
        zero = cu[:1] * 0
        long_cu = torch.cat([zero, (lengths * cut).cumsum(0)])
        short_cu = torch.cat([zero, (lengths * ~cut).cumsum(0)])
        if self.known:
            self.cut = cut.tolist()
            self.long_rows = int(long_cu[-1]) // world  # L
            self.short_rows = local_len - self.long_rows  # C
            cut_lengths = [n for n, c in zip(lengths.tolist(), self.cut) if c]
            compact = [0, *torch.tensor(cut_lengths, dtype=torch.long).cumsum(0).tolist()]
            self.long = Documents(torch.tensor(compact, dtype=torch.int32).to(device),
                                  max(cut_lengths, default=1), compact)
            self.max_short = max([n for n, c in zip(lengths.tolist(), self.cut) if not c],
                                 default=1)
        else:
            self.cut = None
            self.long_rows, self.short_rows = None, None
            self.long = Documents(long_cu.to(torch.int32), docs.max_len)
            # a bound on a short document's length: shorter than the cut length
            self.max_short = max(1, min(docs.max_len, cut_length(world, local_len) - 1,
                                        local_len))
        # Per document (N + 1 entries, on the device), for positions and the traced blocks
        self.cu = docs.cu.long() if not self.known else cu.to(device)
        self.long_cu, self.short_cu = long_cu.to(device), short_cu.to(device)
        self._long_tokens = self.long_cu[-1]
        self.long_len = torch.div(self._long_tokens, world, rounding_mode="floor")  # L (0-d)
        self.short_len = local_len - self.long_len  # C (0-d)

    # --- rows each rank exchanges ----------------------------------------------------------

    def exchanged_rows(self) -> int:
        """The K/V rows another rank needs: the long part's L rows (every row, traced)."""
        return self.long_rows if self.known else self.local_len

    def gathered_positions(self, layout) -> torch.Tensor:
        """Long-stream positions of every rank's exchanged rows, rank 0's first (what an
        all-gather of them holds): a permutation of [0, W x exchanged rows)."""
        rows = self.exchanged_rows()
        return self.docs.cached(("placement_gathered", layout.name, self.world, self.local_len),
                                lambda: torch.cat([self.stream_positions(layout, r)[:rows]
                                                   for r in range(self.world)]))

    # --- positions --------------------------------------------------------------------------

    def stream_positions(self, layout, rank: int) -> torch.Tensor:
        """Rank ``rank``'s local rows as positions in the long stream (its first L rows; the
        others follow the long stream, at positions [W L, W S_local), so that the ranks' rows
        together are a permutation of [0, W S_local))."""
        tail = torch.full((1,), self.world * self.local_len, dtype=torch.long,
                          device=self.long_cu.device)
        extended = self.docs.cached(("placement_stream", self.world, self.local_len), lambda: (
            Documents(torch.cat([self.long_cu, tail]).to(torch.int32), self.docs.max_len)))
        return layout.document_positions(self.local_len, rank, self.world, extended)

    def positions(self, layout, rank: int) -> torch.Tensor:
        """Global positions (int64) of rank ``rank``'s local rows."""
        stream = self.stream_positions(layout, rank)
        rows = torch.arange(self.local_len, device=stream.device)
        in_long = rows < self.long_len
        short = rank * self.short_len + rows - self.long_len
        return torch.where(in_long, _to_global(stream, self.long_cu, self.cu),
                           _to_global(short, self.short_cu, self.cu))

    # --- blocks -------------------------------------------------------------------------------

    def short_bounds(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s short documents as local rows, [L, ..., S_local] (int32): only its own
        ones where the values are known, else one entry per document (empty ones elsewhere)."""
        def make():
            if not self.known:
                clipped = torch.minimum((self.short_cu - rank * self.short_len).clamp_min(0),
                                        self.short_len)  # (a tensor bound: no host read)
                return (self.long_len + clipped).to(torch.int32)
            host = self.docs.host
            part, lo = self.short_rows, self.long_rows
            ends, at = [], 0
            for (a, b), cut in zip(zip(host, host[1:]), self.cut):
                if not cut:
                    at += b - a
                    if rank * part < at <= (rank + 1) * part:
                        ends.append(lo + at - rank * part)
            return torch.tensor([lo, *ends], dtype=torch.int32).to(self.cu.device)
        return self.docs.cached(("placement_short", self.world, self.local_len, rank), make)

    def own_blocks(self, rank: int, is_causal: bool):
        """Step 0's block (the rank's own K/V): one varlen block over every row, the long part's
        own segments then the short documents', so that one kernel call covers both (measured:
        two calls cost 0.10 ms more per forward and 0.21 ms per backward than one, on an H200 at
        8K tokens per GPU, 32/8 heads). The long part's own segments are each cut document's
        local rows, square, as zigzag's and stripe's own block has them; traced, one entry per
        document (empty ones for the short documents)."""
        return self.docs.cached(("placement_own", self.world, self.local_len, rank, is_causal),
                                lambda: [self._own_block(rank, is_causal)])

    def _own_block(self, rank, is_causal):
        every = slice(0, self.local_len)
        bounds = torch.cat([torch.div(self.long.cu, self.world, rounding_mode="floor"),
                            self.short_bounds(rank)[1:]]).to(torch.int32)
        longest = max(self.long.max_len // self.world, self.max_short)
        return Block(every, every, "causal" if is_causal else "none",
                     Segments(bounds, bounds, longest, longest))

    def short_block(self, rank: int, is_causal: bool):
        """The block of rank ``rank``'s short documents on its own K/V (None if it holds none):
        rows and keys [L, S_local) with the values known; traced, every row and key, the long
        part's rows in segments with no keys (pieces no longer than the block's bound) and its
        keys in a segment with no rows."""
        return self.docs.cached(("placement_short_block", self.world, self.local_len, rank,
                                 is_causal), lambda: self._short_block(rank, is_causal))

    def _short_block(self, rank, is_causal):
        mask = "causal" if is_causal else "none"
        if self.known:
            if not self.short_rows:
                return None
            lo = self.long_rows
            relative = self.short_bounds(rank) - lo
            rows = slice(lo, self.local_len)
            longest = min(self.max_short, self.short_rows)
            return Block(rows, rows, mask, Segments(relative, relative, longest, longest))
        every = slice(0, self.local_len)
        count = -(-self.local_len // self.max_short)
        zero = torch.zeros(1, dtype=torch.int32, device=self.long_cu.device)
        cu_q, cu_k = inert(zero, zero, self.long_len, self.long_len, count, count)
        short = self.short_bounds(rank)
        cu_q, cu_k = torch.cat([cu_q, short[1:]]), torch.cat([cu_k, short[1:]])
        return Block(every, every, mask, Segments(cu_q, cu_k, self.max_short, self.max_short))

    def long_blocks(self, layout, rank: int, src: int, is_causal: bool):
        """The blocks of a step src != rank: the layout's per-document grid on the long part
        (traced: over every row, the rows and keys past the long part inert)."""
        rows = self.exchanged_rows()
        if rows == 0:
            return []
        blocks = layout.document_ring_blocks(rows, rank, src, self.world, is_causal, self.long)
        if self.known:
            return blocks
        return self.docs.cached(
            ("placement_long", layout.name, self.world, self.local_len, rank, src, is_causal),
            lambda: [with_inert_tail(b, rows, rows) for b in blocks])


def exchanged_rows(docs, world: int, local_len: int) -> int:
    """``Placement.exchanged_rows`` of ``docs`` (every row without documents), without deriving
    the placement where it needs no host values: a schedule posts its first exchange before it
    derives the blocks that exchange overlaps."""
    if docs is None or docs.host is None:
        return local_len
    return placement_of(docs, world, local_len).exchanged_rows()


def placement_of(docs, world: int, local_len: int) -> Placement:
    """The placement of ``docs`` for ``world`` ranks of ``local_len`` rows, derived once."""
    return docs.cached(("placement", world, local_len), lambda: Placement(docs, world, local_len))


def _to_global(stream: torch.Tensor, stream_cu: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Positions in a stream of documents (``stream_cu``: its boundaries, one entry per document
    of the row, empty ones included) -> positions in the row (``cu``). ``right=True``: of several
    documents starting at a position the last, the one non-empty there."""
    doc = (torch.searchsorted(stream_cu, stream, right=True) - 1).clamp(0, cu.shape[0] - 2)
    return cu[doc] + stream - stream_cu[doc]


def with_inert_tail(block, rows: int, keys: int):
    """A traced block over ``rows`` q rows and ``keys`` keys whose segments end before (at the
    long part's end, known only as a tensor): the q rows past it in segments with no keys, then
    the keys past it in segments with no rows, each no longer than the block's bounds."""
    seg = block.segments
    cu_q, cu_k = inert(seg.cu_q, seg.cu_k, rows, keys, -(-rows // max(1, seg.max_q)),
                       -(-keys // max(1, seg.max_k)))
    return Block(block.q, block.k, block.mask, seg._replace(cu_q=cu_q, cu_k=cu_k))


def inert(cu_q: torch.Tensor, cu_k: torch.Tensor, rows, keys, q_pieces: int, k_pieces: int):
    """``cu_q`` / ``cu_k`` extended to ``rows`` / ``keys`` by segments that attend nothing: the
    q rows from ``cu_q[-1]`` on in ``q_pieces`` segments with no keys, then the keys from
    ``cu_k[-1]`` on in ``k_pieces`` segments with no rows (equal pieces: the counts are static,
    the ends may be tensors). A varlen kernel reaches only ``max_q`` rows and ``max_k`` keys of a
    segment, so the pieces are no longer than those bounds; rows with no key get out 0 and LSE
    -inf, keys no row sees dK = dV = 0."""
    q_from, k_from = cu_q[-1:].long(), cu_k[-1:].long()
    q_steps = torch.arange(1, q_pieces + 1, device=cu_q.device)
    k_steps = torch.arange(1, k_pieces + 1, device=cu_q.device)
    q_ends = q_from + torch.div((rows - q_from) * q_steps, max(1, q_pieces),
                                rounding_mode="floor")
    k_ends = k_from + torch.div((keys - k_from) * k_steps, max(1, k_pieces),
                                rounding_mode="floor")
    q_last = q_ends[-1:] if q_pieces else q_from
    return (torch.cat([cu_q, q_ends.to(cu_q.dtype), q_last.expand(k_pieces).to(cu_q.dtype)]),
            torch.cat([cu_k, k_from.expand(q_pieces).to(cu_k.dtype), k_ends.to(cu_k.dtype)]))


# --- arranging a batch so that the rule keeps its short documents whole (dr.pad_documents) -----

def plan_row(lengths: list[int], world: int, length: int | None = None) -> list[tuple[int, int]]:
    """A row the rule of the module docstring places with its short documents whole, from the
    documents' ``lengths``: [(document, padded length)] in row order, document -1 for a
    padding document. ``length``: the row's length (a multiple of 2W); None: the shortest.

    The cut documents come first, each padded to a multiple of 2W, a long one last (the rule cuts
    every document up to the last long one). Then each rank's group of short documents, in their
    order, padded to C tokens by padding documents at its end (each at most a tile).
    The groups: the short documents largest first, each onto the rank with the least causal work
    among those with room for it (C: the short tokens / W, rounded up to an even count, or what
    ``length`` leaves). For a document with no room C grows, while the row's padding stays
    within ``PADDING_BUDGET``, else the document is cut too; where the groups miss the rule's
    balance, the largest short document is cut too. Cutting a document when none is long pads
    the largest cut one to the cut length."""
    total = sum(lengths)
    unit = 2 * world
    local = 2 * -(-max(total, length or 0) // unit)
    for _ in range(8):  # the cut length depends on the local length, which the padding sets
        cut_from = cut_length(world, local)
        row = _plan(lengths, world, cut_from, length)
        local = sum(p for _, p in row) // world
        if cut_length(world, local) == cut_from:
            return row
    raise AssertionError(f"plan_row: no fixed point for {lengths}, W={world}")


def _plan(lengths, world, cut_from, length):
    unit, total = 2 * world, sum(lengths)
    by_size = sorted(range(len(lengths)), key=lambda d: (-lengths[d], d))
    cut = {d for d in by_size if lengths[d] >= cut_from}
    while True:
        prefix = _prefix(cut, lengths, cut_from, unit)
        long_rows = sum(p for _, p in prefix) // world
        short = [d for d in by_size if d not in cut]
        need = -(-sum(lengths[d] for d in short) // world)
        part = need + need % 2 if length is None else length // world - long_rows
        while part >= need:
            groups, overflow = _groups(short, lengths, world, part)
            if groups is not None:
                break
            d, growth = overflow
            # Room for the document that found none: every rank's part grows (padding) while the
            # padding stays within the budget, else it is cut.
            padding = world * (part + growth + long_rows) - total
            if length is not None or padding > PADDING_BUDGET * (total + padding):
                break
            part += growth
        else:
            raise ValueError(
                f"length={length} is too short to place these documents on {world} ranks: "
                f"{sum(lengths)} tokens, {long_rows * world} of them (with padding) in the "
                f"documents cut across the ranks, each rank's share of the others at most "
                f"{part} tokens")
        if groups is None:
            cut.add(d)
            continue
        row = list(prefix)
        # Padding documents attend themselves, p (p + 1) / 2 pairs on one rank: pieces of at
        # most a tile (an eighth of a rank's tokens in short rows) keep that small beside the
        # rank's share, and shorter than the cut length.
        piece = max(1, min(TILE_ROWS, cut_from - 1, (long_rows + part) // 8))
        for group in groups:
            row += [(d, lengths[d]) for d in sorted(group)]
            row += [(-1, n) for n in _split(part - sum(lengths[d] for d in group), piece)]
        bounds = torch.tensor([0, *[p for _, p in row]]).cumsum(0)
        wanted = [i < len(prefix) for i in range(len(row))]
        if cut_documents(bounds, world, long_rows + part).tolist() == wanted:
            return row
        if not short:
            raise AssertionError(f"plan_row: no placement of {lengths} on {world} ranks")
        cut.add(short[0])  # off balance: the largest short document is cut too


def _prefix(cut, lengths, cut_from, unit):
    """The cut documents as the row's prefix: (document, padded length) in their order, each
    padded to a multiple of ``unit``, the last a long one (padded to the cut length if none is)."""
    padded = {d: -(-lengths[d] // unit) * unit for d in cut}
    if not cut:
        return []
    longs = [d for d in sorted(cut) if padded[d] >= cut_from]
    anchor = longs[-1] if longs else max(cut, key=lambda d: (lengths[d], -d))
    padded[anchor] = max(padded[anchor], cut_from)
    return [(d, padded[d]) for d in sorted(cut) if d != anchor] + [(anchor, padded[anchor])]
def _groups(short, lengths, world, part):
    """Each rank's short documents: largest first (``short`` is in that order), each onto the
    rank with the least causal work among those with room for it in ``part`` tokens. Returns
    (groups, None), or (None, (the first document with no room, the part's growth that would
    give it room where it overflows least, an even count))."""
    tokens, work, groups = [0] * world, [0] * world, [[] for _ in range(world)]
    for d in short:
        n = lengths[d]
        room = [r for r in range(world) if tokens[r] + n <= part]
        if not room:
            growth = min(tokens) + n - part
            return None, (d, growth + growth % 2)
        r = min(room, key=lambda r: (work[r], tokens[r], r))
        groups[r].append(d)
        tokens[r] += n
        work[r] += n * (n + 1) // 2
    return groups, None
def _split(tokens: int, longest: int) -> list[int]:
    """``tokens`` of padding as documents of at most ``longest`` tokens (none for 0)."""
    count = -(-tokens // max(1, longest))
    return [tokens * (i + 1) // count - tokens * i // count for i in range(count)]
