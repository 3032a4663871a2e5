"""The reshard plan: which bytes move from whom to whom, bucket by bucket. Pure Python, no I/O.

Every rank computes the same plan from the same all-gathered metadata, so the plan is also the
schedule: ranks walk its buckets and ops in order and call only the ops they take part in.

Geometry. A tensor split over tp_dim is cut, inside each of its `sub_chunks` blocks, into
L = lcm(train split, rollout tp) equal units; training shard j holds units [j L/t, (j+1) L/t) of
every block and rollout rank q needs [q L/G, (q+1) L/G). A replicated tensor has one unit. A
rank receives exactly (needed - held), from a holder chosen in its own training replica and
micro-DP group when possible, so an all-gather inside each micro-DP group is what the plan
becomes in the HybridFlow case. Tensors bigger than a bucket are cut along a non-TP dimension
("rows") into parts that each fit.

The module is long because the plan's types and the steps that fill them read together: `make_plan`
only sequences its pieces (rollout rows and unit checks, the lower bound, `_Sources` choosing who
sends, `_cut_buckets` and `_group_ops`), each a function or class of its own below.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

import torch

from megarl.layout import ParallelLayout, RolloutAssignment

ALIGN = 8  # bytes; every chunk starts aligned so a byte buffer can be viewed as any dtype


@dataclass(frozen=True)
class Span:
    lo: int
    hi: int

    def __and__(self, other: "Span") -> "Span | None":
        lo, hi = max(self.lo, other.lo), min(self.hi, other.hi)
        return Span(lo, hi) if lo < hi else None


@dataclass(frozen=True)
class TensorSpec:
    """A global tensor and who holds which training shard of it."""

    name: str
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    tp_dim: int | None
    tp_size: int
    sub_chunks: int
    holders: tuple[tuple[int, int], ...]  # (global rank, training tp rank), sorted
    # Rows of tp_dim that rollout rank q needs, where the engine does not split evenly (a padded
    # vocabulary: vLLM pads to its own multiple, so its shard boundaries are not the trainer's).
    # Spans are then counted in rows.
    rollout_rows: tuple[tuple[int, int], ...] | None = None

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return math.prod(self.full_shape) * self.itemsize

    @property
    def split_dim(self) -> int | None:
        """The dimension oversized tensors are cut along (never the TP one)."""
        if len(self.full_shape) < 2:
            return None
        return 1 if self.tp_dim == 0 else 0

    def units(self, rollout_tp: int) -> int:
        if self.tp_dim is None:
            return 1
        if self.rollout_rows is not None:
            return self.full_shape[self.tp_dim]
        return math.lcm(self.tp_size, rollout_tp)

    def held_span(self, tp_rank: int, L: int) -> Span:
        if self.tp_dim is None:
            return Span(0, 1)
        w = L // self.tp_size
        return Span(tp_rank * w, (tp_rank + 1) * w)

    def needed_span(self, q: int, rollout_tp: int, L: int) -> Span:
        if self.tp_dim is None:
            return Span(0, 1)
        if self.rollout_rows is not None:
            return Span(*self.rollout_rows[q])
        w = L // rollout_tp
        return Span(q * w, (q + 1) * w)

    def span_shape(self, span: Span, L: int, rows: tuple[int, int] | None = None) -> tuple[int, ...]:
        """Shape of the tensor holding `span` of every block (and `rows` of split_dim)."""
        shape = list(self.full_shape)
        if self.tp_dim is not None:
            shape[self.tp_dim] = shape[self.tp_dim] // L * (span.hi - span.lo)
        if rows is not None:
            assert self.split_dim is not None, "rows of a tensor that is not split"
            shape[self.split_dim] = rows[1] - rows[0]
        return tuple(shape)

    def span_nbytes(self, span: Span, L: int, rows: tuple[int, int] | None = None) -> int:
        return math.prod(self.span_shape(span, L, rows)) * self.itemsize


@dataclass(frozen=True)
class Chunk:
    """`span` of tensor `name` (rows of split_dim, or all rows), as `nbytes` contiguous bytes."""

    name: str
    span: Span
    rows: tuple[int, int] | None
    nbytes: int

    @property
    def padded(self) -> int:
        return -(-self.nbytes // ALIGN) * ALIGN


@dataclass
class Op:
    """One communication. kind: "broadcast" (src to group), "all_gather" (every member of group
    contributes one equal-sized segment), "p2p" (src sends the same bytes to each dst)."""

    kind: str
    src: int  # -1 for all_gather
    dsts: tuple[int, ...]
    group: tuple[int, ...] | None
    chunks: list[Chunk]  # broadcast / p2p: in buffer order
    segments: list[tuple[int, list[Chunk]]] = field(default_factory=list)  # all_gather: (src, chunks) per member

    @property
    def nbytes(self) -> int:
        if self.kind == "all_gather":
            return sum(sum(c.padded for c in chunks) for _, chunks in self.segments)
        return sum(c.padded for c in self.chunks)

    @property
    def participants(self) -> tuple[int, ...]:
        if self.group is not None:
            return self.group
        return (self.src,) + self.dsts

    def buffer_bytes(self, rank: int) -> int:
        """Bytes of this op's staging buffer on `rank` (0 when it is not involved)."""
        return self.nbytes if rank in self.participants else 0


@dataclass
class Entry:
    """A tensor (or a rows-part of one) whose rollout shard is assembled after its bucket's ops."""

    name: str
    rows: tuple[int, int] | None
    last: bool  # the tensor is complete after this entry: convert and yield it


@dataclass
class Bucket:
    ops: list[Op]
    entries: list[Entry]
    transfers: list[tuple[Chunk, int, tuple[int, ...]]]  # (chunk, src, dsts) before grouping into ops


@dataclass
class Plan:
    specs: dict[str, TensorSpec]
    order: list[str]
    train: ParallelLayout
    assignment: RolloutAssignment
    rollout_tp: int
    bucket_bytes: int
    buckets: list[Bucket]
    min_recv_bytes: list[int]  # per rank: sum over tensors of (needed - held)
    planned_recv_bytes: list[int]  # per rank, payload only (no alignment padding)
    largest_tensor_bytes: int
    model_bytes: int
    needed_bytes: list[int] = field(default_factory=list)  # per rank: its rollout shard of every tensor
    # ranks that load rollout shards; None: every rank (colocated). Separate placement: the
    # rollout ranks only, which hold nothing, so each receives exactly its rollout shard.
    receivers: tuple[int, ...] | None = None

    def receives(self, rank: int) -> bool:
        return self.receivers is None or rank in self.receivers

    def units(self, name: str) -> int:
        return self.specs[name].units(self.rollout_tp)

    def needed_span(self, rank: int, name: str) -> Span:
        s = self.specs[name]
        return s.needed_span(self.assignment.rollout_tp_rank[rank], self.rollout_tp, self.units(name))

    def held_tp_rank(self, rank: int, name: str) -> int | None:
        for h, j in self.specs[name].holders:
            if h == rank:
                return j
        return None


def natural_key(name: str):
    """Sort "layers.10" after "layers.9" so each layer's tensors stream together, in order."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def build_specs(per_rank_meta: list[list[tuple]]) -> dict[str, TensorSpec]:
    """Merge every rank's (name, full_shape, dtype, tp_dim, tp_rank, tp_size, sub_chunks, local_shape)."""
    merged: dict[str, dict] = {}
    for rank, metas in enumerate(per_rank_meta):
        for name, full_shape, dtype, tp_dim, tp_rank, tp_size, sub_chunks, local_shape in metas:
            full_shape, local_shape = tuple(full_shape), tuple(local_shape)
            dtype = getattr(torch, str(dtype).replace("torch.", ""))
            # a tp_dim is kept at train tp 1 too: rollout tp > 1 still needs the tensor's split dim
            split = tp_dim is not None
            if split:
                expect = list(full_shape)
                expect[tp_dim] //= tp_size
                if full_shape[tp_dim] % (tp_size * sub_chunks) or tuple(expect) != local_shape:
                    raise ValueError(f"{name} on rank {rank}: local shape {local_shape} is not 1/{tp_size} of {full_shape} on dim {tp_dim} "
                                     f"(with {sub_chunks} sub-chunks)")
            elif local_shape != full_shape:
                raise ValueError(f"{name} on rank {rank}: local shape {local_shape} != full shape {full_shape} but no TP split is declared")
            key = (full_shape, dtype, tp_dim if split else None, tp_size if split else 1, sub_chunks if split else 1)
            m = merged.setdefault(name, {"key": key, "holders": []})
            if m["key"] != key:
                raise ValueError(f"{name}: rank {rank} describes it as {key}, another rank as {m['key']}")
            m["holders"].append((rank, tp_rank if split else 0))
    specs = {}
    for name, m in merged.items():
        full_shape, dtype, tp_dim, tp_size, sub_chunks = m["key"]
        held = {j for _, j in m["holders"]}
        if held != set(range(tp_size)):
            raise ValueError(f"{name}: no rank holds TP shard(s) {sorted(set(range(tp_size)) - held)} of {tp_size}")
        specs[name] = TensorSpec(name, full_shape, dtype, tp_dim, tp_size, sub_chunks, tuple(sorted(m["holders"])))
    return specs


def make_plan(specs: dict[str, TensorSpec], train: ParallelLayout, assignment: RolloutAssignment, rollout_tp: int,
              bucket_bytes: int, rollout_rows: dict[str, tuple[tuple[int, int], ...]] | None = None,
              receivers: tuple[int, ...] | None = None) -> Plan:
    """Decide sources, cut buckets, and group each bucket's transfers into collective ops.

    rollout_rows: {name: rows of tp_dim per rollout rank} for tensors the engine splits unevenly.
    receivers: the ranks that load rollout shards when they are not the training ranks (separate
    placement, megarl.async_rollout.placement): global ranks from train.world_size on, described by
    `assignment` (separate_assignment), holding no training shard.

    The steps, each owned by its own piece: the specs checked and given their rollout rows
    (`_with_rollout_rows`, `_check_units`), the lower bound per rank (`_lower_bound`), the source of
    every piece (`_Sources`), the buckets and their ops (`_cut_buckets`).
    """
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be at least {ALIGN}, got {bucket_bytes}")
    specs = _with_rollout_rows(specs, rollout_rows, rollout_tp)
    W = train.world_size if receivers is None else max(train.world_size, max(receivers) + 1)
    loaders = tuple(range(W)) if receivers is None else tuple(sorted(receivers))
    _check_units(specs, rollout_tp)
    order = sorted(specs, key=natural_key)
    min_recv, needed_bytes = _lower_bound(specs, order, assignment, rollout_tp, W, loaders)
    sources = _Sources(train, assignment, rollout_tp, W, loaders)
    # Source choices balance the send load over tensors in `order`, so they are made in that order.
    routes = {name: sources.routes(specs[name]) for name in order}
    buckets = _cut_buckets(specs, order, routes, rollout_tp, bucket_bytes, W, set(assignment.micro_dp_groups))
    planned_recv = [0] * W
    for b in buckets:
        for chunk, _, dsts in b.transfers:
            for d in dsts:
                planned_recv[d] += chunk.nbytes
    return Plan(specs, order, train, assignment, rollout_tp, bucket_bytes, buckets, min_recv, planned_recv,
                max((s.nbytes for s in specs.values()), default=0), sum(s.nbytes for s in specs.values()), needed_bytes,
                receivers if receivers is None else loaders)


def _with_rollout_rows(specs: dict[str, TensorSpec], rollout_rows: dict[str, tuple[tuple[int, int], ...]] | None,
                       rollout_tp: int) -> dict[str, TensorSpec]:
    """A copy of `specs` whose unevenly split tensors carry their rollout rows (checked)."""
    specs = dict(specs)
    for name, rows in (rollout_rows or {}).items():
        s = specs.get(name)
        if s is None:
            continue  # e.g. a tied output layer the trainer does not stream
        if s.tp_dim is None or s.sub_chunks != 1 or len(rows) != rollout_tp:
            raise ValueError(f"{name}: rollout rows need a tensor split over one tp_dim block and one row range per "
                             f"rollout rank ({rollout_tp}), got tp_dim {s.tp_dim}, {s.sub_chunks} blocks, {len(rows)} ranges")
        if any(not 0 <= lo <= hi <= s.full_shape[s.tp_dim] for lo, hi in rows):
            raise ValueError(f"{name}: rollout rows {rows} outside its {s.full_shape[s.tp_dim]} rows")
        specs[name] = dataclasses.replace(s, rollout_rows=tuple((lo, hi) for lo, hi in rows))
    return specs


def _check_units(specs: dict[str, TensorSpec], rollout_tp: int) -> None:
    """Every TP-split tensor's blocks cut into lcm(train tp, rollout tp) equal units."""
    for name, s in specs.items():
        if s.tp_dim is not None:
            L = s.units(rollout_tp)
            block = s.full_shape[s.tp_dim] // s.sub_chunks
            if block % L:
                raise ValueError(f"{name}: dim {s.tp_dim} has blocks of {block}, not divisible into lcm(train tp {s.tp_size}, "
                                 f"rollout tp {rollout_tp}) = {L} units")


def _lower_bound(specs: dict[str, TensorSpec], order: list[str], assignment: RolloutAssignment, rollout_tp: int,
                 W: int, loaders: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Per rank: the bytes it must receive (needed - held) and its whole rollout shard, both
    independent of source choices."""
    q_of = assignment.rollout_tp_rank
    min_recv = [0] * W
    needed_bytes = [0] * W
    for name in order:
        s = specs[name]
        L = s.units(rollout_tp)
        held_by = {h: s.held_span(j, L) for h, j in s.holders}
        for r in loaders:
            need = s.needed_span(q_of[r], rollout_tp, L)
            have = need & held_by[r] if r in held_by else None
            min_recv[r] += s.span_nbytes(need, L) - (s.span_nbytes(have, L) if have else 0)
            needed_bytes[r] += s.span_nbytes(need, L)
    return min_recv, needed_bytes


class _Sources:
    """Chooses who sends each piece: a holder in the receiver's own training replica and micro-DP
    group when possible, the least loaded so far (the load carries over from tensor to tensor)."""

    def __init__(self, train: ParallelLayout, assignment: RolloutAssignment, rollout_tp: int, W: int,
                 loaders: tuple[int, ...]):
        self.rollout_tp = rollout_tp
        self.loaders = loaders
        self.q_of = assignment.rollout_tp_rank
        self.group_of_rank = {r: g for g in assignment.micro_dp_groups for r in g}
        self.group_members = {g: set(g) for g in assignment.micro_dp_groups}
        # the training replica (cp_rank + cp * dp_rank); a rollout-only rank belongs to none
        self.dp_of = [train.replica(r) if r < train.world_size else -1 for r in range(W)]
        self.send_load = [0] * W

    def routes(self, s: TensorSpec) -> list[tuple[Span, int, tuple[int, ...]]]:
        """[(piece, src, dsts)] so that every rank ends up with its needed span of s."""
        rollout_tp, q_of, send_load = self.rollout_tp, self.q_of, self.send_load
        group_of_rank, group_members, dp_of = self.group_of_rank, self.group_members, self.dp_of
        L = s.units(rollout_tp)
        holder_spans: dict[Span, list[int]] = {}
        held_by: dict[int, Span] = {}
        for h, j in s.holders:
            sp = s.held_span(j, L)
            holder_spans.setdefault(sp, []).append(h)
            held_by[h] = sp
        choice: dict[tuple[Span, tuple[int, ...]], int] = {}
        moves: dict[tuple[Span, int], list[int]] = {}
        for r in self.loaders:
            need = s.needed_span(q_of[r], rollout_tp, L)
            for sp, holders in holder_spans.items():
                piece = need & sp
                if piece is None or held_by.get(r) == sp:
                    continue
                # One source per (piece, micro-DP group): the members then share one broadcast.
                key = (piece, group_of_rank[r])
                if key not in choice:
                    pool = [h for h in holders if dp_of[h] == dp_of[r]] or holders
                    pool = [h for h in pool if h in group_members[group_of_rank[r]]] or pool
                    src = min(pool, key=lambda h: (send_load[h], h))
                    choice[key] = src
                    send_load[src] += s.span_nbytes(piece, L)
                moves.setdefault((piece, choice[key]), []).append(r)
        return [(piece, src, tuple(sorted(dsts))) for (piece, src), dsts in sorted(moves.items(), key=lambda kv: (kv[0][0].lo, kv[0][1]))]


def _cut_buckets(specs: dict[str, TensorSpec], order: list[str], routes: dict[str, list], rollout_tp: int,
                 bucket_bytes: int, W: int, micro_groups: set[tuple[int, ...]]) -> list[Bucket]:
    """Fill buckets with whole tensors in `order` while every rank's bytes fit; a tensor that does
    not fit alone is cut along its split_dim into parts that each fit."""

    def transfers_for(s: TensorSpec, rts, rows) -> list[tuple[Chunk, int, tuple[int, ...]]]:
        L = s.units(rollout_tp)
        return [(Chunk(s.name, piece, rows, s.span_nbytes(piece, L, rows)), src, dsts) for piece, src, dsts in rts]

    def cost(transfers) -> list[int]:
        c = [0] * W
        for chunk, src, dsts in transfers:
            c[src] += chunk.padded
            for d in dsts:
                c[d] += chunk.padded
        return c

    buckets: list[Bucket] = []
    cur_entries: list[Entry] = []
    cur_transfers: list = []
    cur_cost = [0] * W

    def close():
        nonlocal cur_entries, cur_transfers, cur_cost
        if cur_entries:
            buckets.append(Bucket(_group_ops(cur_transfers, micro_groups), cur_entries, cur_transfers))
        cur_entries, cur_transfers, cur_cost = [], [], [0] * W

    for name in order:
        s = specs[name]
        rts = routes[name]
        whole = transfers_for(s, rts, None)
        whole_cost = cost(whole)
        if max(whole_cost) <= bucket_bytes or s.split_dim is None:
            if any(a + b > bucket_bytes for a, b in zip(cur_cost, whole_cost)):
                close()
            cur_entries.append(Entry(name, None, True))
            cur_transfers.extend(whole)
            cur_cost = [a + b for a, b in zip(cur_cost, whole_cost)]
            continue
        # Oversized: cut along split_dim into parts that each fit in a bucket (bytes scale with rows).
        close()
        n_rows = s.full_shape[s.split_dim]
        parts = min(n_rows, -(-max(whole_cost) // bucket_bytes))
        while parts < n_rows and max(cost(transfers_for(s, rts, (0, -(-n_rows // parts))))) > bucket_bytes:
            parts += 1
        bounds = [n_rows * i // parts for i in range(parts + 1)]
        for i in range(parts):
            tr = transfers_for(s, rts, (bounds[i], bounds[i + 1]))
            buckets.append(Bucket(_group_ops(tr, micro_groups), [Entry(name, (bounds[i], bounds[i + 1]), i == parts - 1)], tr))
    close()
    return buckets


def _group_ops(transfers, micro_groups: set[tuple[int, ...]]) -> list[Op]:
    """Group a bucket's transfers by (src, dsts); a transfer to the rest of a micro-DP group is a
    broadcast there, and a group whose members all broadcast equal sizes becomes one all_gather."""
    by_route: dict[tuple[int, tuple[int, ...]], list[Chunk]] = {}
    for chunk, src, dsts in transfers:
        by_route.setdefault((src, dsts), []).append(chunk)
    ops: list[Op] = []
    bcast_by_group: dict[tuple[int, ...], list[Op]] = {}
    for (src, dsts), chunks in sorted(by_route.items()):
        group = tuple(sorted((src,) + dsts))
        if group in micro_groups:
            op = Op("broadcast", src, dsts, group, chunks)
            bcast_by_group.setdefault(group, []).append(op)
        else:
            ops.append(Op("p2p", src, dsts, None, chunks))
    for group, bops in sorted(bcast_by_group.items()):
        sizes = {op.nbytes for op in bops}
        if len(bops) == len(group) and len(sizes) == 1:
            by_src = {op.src: op.chunks for op in bops}
            ops.append(Op("all_gather", -1, group, group, [], [(m, by_src[m]) for m in group]))
        else:
            ops.extend(bops)
    ops.sort(key=lambda op: (min(op.participants), op.kind, op.src, op.dsts))
    return ops
