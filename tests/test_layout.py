"""Tier 1: partition math, no process group.

Catches shards that overlap or leave gaps, misaligned parameter starts, buckets whose size is not
a multiple of world_size * alignment or whose rank pieces are unequal, buckets that split a
parameter or miss elements, segments that do not tile a shard, logical offsets that depend on the
world size, and views that do not round-trip through the flat buffer.
"""
from __future__ import annotations

import math

import pytest
import torch

from shardopt.core._flat import FlatParams
from shardopt.core._layout import Range, build_layout

SHAPES = {
    "one": [(1,)],
    "odd": [(7,), (17, 257), (1,), (3, 5, 2)],
    "tiny": [(1,), (2,), (1,)],
    "with_empty": [(4,), (0,), (9, 3)],
    "many": [(i % 13 + 1,) for i in range(40)],
}


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("world_size", range(1, 9))
@pytest.mark.parametrize("bucket_numel", [None, 1, 50])
def test_shards_cover_buffer_once(name, world_size, bucket_numel):
    shapes = SHAPES[name]
    layout = build_layout(shapes, world_size, alignment=8, bucket_numel=bucket_numel)
    numels = [math.prod(s) for s in shapes]
    # Padding: each bucket is the smallest multiple of world_size*8 holding its aligned parameters.
    assert layout.numel % (world_size * 8) == 0
    assert layout.numel - layout.params[-1].global_range.end < world_size * 8
    for b in layout.buckets:
        assert b.global_range.size % (world_size * 8) == 0 and b.global_range.size == world_size * b.piece_numel
        last = max([layout.params[i].global_range.end for i in b.params], default=b.global_range.start)
        assert b.global_range.end - last < world_size * 8
    # Parameters: aligned, in order, not overlapping, right sizes.
    end = 0
    for span, n in zip(layout.params, numels):
        assert span.global_range.start % 8 == 0 and span.global_range.start >= end
        assert span.numel == n
        end = span.global_range.end
    # Shards: one equal piece of each bucket per rank, in rank order; together they cover [0, numel)
    # exactly once, and each rank's pieces tile its local coordinates in bucket order.
    covered = torch.zeros(layout.numel, dtype=torch.int32)
    for r in range(world_size):
        pos = 0
        for local, glob in layout.shard_runs(r):
            b = next(b for b in layout.buckets if b.global_range.start <= glob.start < b.global_range.end)
            assert glob == Range(b.global_range.start + r * b.piece_numel, b.global_range.start + (r + 1) * b.piece_numel)
            assert local == Range(pos, pos + glob.size) and glob.size % 8 == 0
            pos = local.end
            covered[glob.start:glob.end] += 1
        assert pos == layout.shard_numel
    assert bool((covered == 1).all())
    # Pieces: every parameter element is owned by exactly one rank, with consistent ranges.
    owned = [torch.zeros(n, dtype=torch.int32) for n in numels]
    for r in range(world_size):
        runs = layout.shard_runs(r)
        for piece in layout.shard_pieces(r):
            span = layout.params[piece.param]
            assert piece.global_range.size == piece.param_range.size == piece.local_range.size
            assert piece.global_range.start == span.global_range.start + piece.param_range.start
            local, glob = next((lo, g) for lo, g in runs if g.start <= piece.global_range.start < g.end)
            assert piece.local_range.start == piece.global_range.start - glob.start + local.start
            assert layout.to_global(r, piece.local_range) == piece.global_range
            owned[piece.param][piece.param_range.start:piece.param_range.end] += 1
    assert all(bool((o == 1).all()) for o in owned)
    # Buckets: tile the buffer, never split a parameter, respect the cap unless one param is bigger.
    start = 0
    members = []
    for b in layout.buckets:
        assert b.global_range.start == start
        start = b.global_range.end
        members += list(b.params)
        for i in b.params:
            r = layout.params[i].global_range
            assert b.global_range.start <= r.start and r.end <= b.global_range.end
        if bucket_numel is not None and len(b.params) > 1:
            last = layout.params[b.params[-1]].global_range.end
            assert last - b.global_range.start <= bucket_numel
    assert start == layout.numel and members == list(range(len(shapes)))
    # Per-bucket rank pieces tile each bucket.
    for b in layout.buckets:
        pieces = layout.bucket_shard_ranges(b.index)
        assert sum(p.size for p in pieces) == b.global_range.size
    # Logical offsets: every parameter element's is its offset in the one-rank layout.
    one = build_layout(shapes, 1, alignment=8, bucket_numel=bucket_numel)
    assert [len(b.params) for b in one.buckets] == [len(b.params) for b in layout.buckets]
    for r in range(world_size):
        for piece in layout.shard_pieces(r):
            for k in (piece.local_range.start, piece.local_range.end - 1):
                in_param = piece.param_range.start + k - piece.local_range.start
                assert layout.logical_offset(r, k) == one.params[piece.param].global_range.start + in_param


@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_segments_tile_shard_by_key(world_size):
    shapes = SHAPES["odd"] + SHAPES["many"]
    keys = [i % 3 == 0 for i in range(len(shapes))]
    layout = build_layout(shapes, world_size)
    for r in range(world_size):
        segs = layout.segments(r, keys)
        pos = 0
        for key, rng in segs:
            assert rng.start == pos
            pos = rng.end
        assert pos == layout.shard_numel
        for piece in layout.shard_pieces(r):  # every piece lies in a segment with its own key
            hits = [k for k, rng in segs if rng.start <= piece.local_range.start and piece.local_range.end <= rng.end]
            assert hits == [keys[piece.param]]


def test_more_ranks_than_elements():
    layout = build_layout([(1,), (2,)], world_size=8)
    owners = [r for r in range(8) if layout.shard_pieces(r)]
    assert owners == [0, 1]  # each parameter starts on an 8-element boundary: one per piece
    assert sum(len(layout.shard_pieces(r)) for r in range(8)) == 2


def test_flat_params_are_views_that_round_trip():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s)) for s in SHAPES["odd"]]
    before = [p.detach().clone() for p in params]
    layout = build_layout([p.shape for p in params], world_size=3)
    flat = FlatParams(params, layout)
    for p, b, span in zip(params, before, layout.params):
        assert torch.equal(p.detach(), b)
        assert p.data.data_ptr() == flat.data[span.global_range.start:].data_ptr()
    flat.data.add_(1.0)  # writing the buffer writes the model
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b + 1)
    padding = torch.ones(layout.numel, dtype=torch.bool)
    for span in layout.params:
        padding[span.global_range.start:span.global_range.end] = False
    assert bool((flat.data[padding] == 1.0).all())  # padding started at zero


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="world_size=0"):
        build_layout([(3,)], 0)
    with pytest.raises(ValueError, match="bucket_numel=0"):
        build_layout([(3,)], 2, bucket_numel=0)
    with pytest.raises(ValueError, match="rank=2"):
        build_layout([(3,)], 2).shard_runs(2)


def test_param_runs_and_local_ranges():
    layout = build_layout([(3,), (5,), (1,), (17,)], world_size=2)
    spans = [p.global_range for p in layout.params]
    runs = layout.param_runs([3, 0, 1, 1])
    assert runs == [Range(spans[0].start, spans[1].end), spans[3]]
    assert layout.param_runs([]) == []
    for rank in range(2):
        (local, shard), = layout.shard_runs(rank)  # one bucket: one piece per rank
        expected = {i: s.intersect(shard).relative_to(shard.start - local.start) for i, s in enumerate(spans)
                    if s.intersect(shard).size}
        assert layout.local_ranges(rank) == expected


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_bucket_pieces_and_local_ranges_follow_element_ownership(world_size):
    """Each rank's piece of each bucket, relative to the bucket and to the rank's shard, against
    a count of the elements the rank owns in the bucket (those the shard's pieces name), one
    element at a time; every rank's piece of a bucket is the same size."""
    layout = build_layout([(5, 7), (3,), (40,), (2, 2)], world_size, alignment=4, bucket_numel=48)
    n = layout.shard_numel
    owner = {}
    for rank in range(world_size):
        for piece in layout.shard_pieces(rank):
            for e in range(piece.global_range.start, piece.global_range.end):
                owner[e] = (rank, piece.local_range.start + e - piece.global_range.start)
    for rank in range(world_size):
        local = layout.bucket_local_ranges(rank)
        for b in layout.buckets:
            owned = [e for e in range(b.global_range.start, b.global_range.end) if owner.get(e, (None,))[0] == rank]
            piece = layout.bucket_pieces(b.index)[rank]
            assert piece.size == local[b.index].size == b.global_range.size // world_size
            assert len(owned) <= piece.size
            for e in owned:  # each owned element sits in its piece, at its place in the shard
                assert piece.start <= e - b.global_range.start < piece.end
                assert owner[e][1] == local[b.index].start + e - b.global_range.start - piece.start
        assert sum(r.size for r in local) == n  # the buckets tile the shard


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_shard_view_reads_and_writes_the_rank_pieces_of_the_flat_buffer(world_size):
    """``ShardView``: local ranges map to the rank's pieces (checked element by element against
    ``shard_pieces``), a range across two pieces is refused, and the whole shard reads and writes
    through its pieces; one rank's shard is the flat buffer itself."""
    from shardopt.core._flat import ShardView

    layout = build_layout(SHAPES["odd"], world_size, bucket_numel=50)
    flat = torch.arange(layout.numel, dtype=torch.float32)
    for rank in range(world_size):
        view = ShardView(flat, layout.shard_runs(rank), layout.shard_numel)
        for piece in layout.shard_pieces(rank):
            got = view[piece.local_range.as_slice()]
            assert torch.equal(got, flat[piece.global_range.as_slice()])
            assert got.data_ptr() == flat[piece.global_range.start:].data_ptr()  # a view
        whole = view.read()
        for local, glob in layout.shard_runs(rank):
            assert torch.equal(whole[local.as_slice()], flat[glob.as_slice()])
        runs = layout.shard_runs(rank)
        if len(runs) > 1:
            with pytest.raises(AssertionError, match="not within one piece"):
                view[runs[0][0].end - 1:runs[1][0].start + 1]
        assert (whole.data_ptr() == flat.data_ptr()) == (world_size == 1)  # one rank: no copy
        window = view.window(Range(runs[-1][0].start, layout.shard_numel))
        assert torch.equal(window.read(), flat[runs[-1][1].as_slice()])
    target = flat.clone()
    view = ShardView(target, layout.shard_runs(world_size - 1), layout.shard_numel)
    view.copy_(-torch.ones(layout.shard_numel))
    changed = (target != flat).nonzero().flatten().tolist()
    assert changed == [e for _, glob in layout.shard_runs(world_size - 1) for e in range(glob.start, glob.end)
                       if flat[e] != -1]
