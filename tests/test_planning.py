"""Owner planning: deterministic, FLOP-balanced, complete, and fine with more ranks than matrices."""

from __future__ import annotations

import pytest
import torch

from lightning_muon.distributed.planning import expert_blocks, matrix_shapes, plan_ownership
from lightning_muon.layout import MatrixLayout
from lightning_muon.newton_schulz import ns_flops


def test_identical_matrices_go_round_robin():
    plan = plan_ownership([(64, 64)] * 6, world_size=3)
    assert plan.owners == (0, 1, 2, 0, 1, 2)
    assert [plan.load(r) for r in range(3)] == [2 * ns_flops(64, 64, 5)] * 3


def test_largest_first_onto_the_least_loaded_rank():
    # FLOPs: (512, 128) >> (128, 128) x 3. LPT puts the big one alone on rank 0.
    shapes = [(128, 128), (512, 128), (128, 128), (128, 128)]
    plan = plan_ownership(shapes, world_size=2)
    assert plan.owners[1] == 0
    assert plan.owned(1) == [0, 2, 3]
    assert plan.load(0) == ns_flops(512, 128, 5)
    assert plan.load(1) == 3 * ns_flops(128, 128, 5)


def test_every_parameter_has_exactly_one_owner_and_the_plan_is_deterministic():
    shapes = [(96, 32), (32, 96), (64, 64), (16, 256), (128, 8), (48, 48), (8, 8)]
    a = plan_ownership(shapes, world_size=3)
    b = plan_ownership(list(shapes), world_size=3)
    assert a == b
    assert sorted(i for r in range(3) for i in a.owned(r)) == list(range(len(shapes)))
    assert sum(a.load(r) for r in range(3)) == sum(a.flops)
    # LPT bound: the busiest rank carries at most 4/3 of the perfect share or the largest job.
    assert max(a.load(r) for r in range(3)) <= max(4 / 3 * sum(a.flops) / 3, max(a.flops))


def test_more_ranks_than_matrices_leaves_ranks_empty():
    plan = plan_ownership([(32, 32), (32, 32)], world_size=3)
    assert plan.owned(2) == []
    assert plan.load(2) == 0 and plan.elements(2) == 0


def test_conv_split_and_batched_shapes_count_each_matrix():
    assert matrix_shapes((8, 3, 3, 3)) == [(8, 27)]
    assert matrix_shapes((96, 32), MatrixLayout(split_sizes=(32, 32, 32))) == [(32, 32)] * 3
    assert matrix_shapes((4, 16, 8), MatrixLayout(batched=True)) == [(16, 8)] * 4
    layouts = [MatrixLayout(split_sizes=(32, 32, 32)), MatrixLayout(batched=True)]
    plan = plan_ownership([(96, 32), (4, 16, 8)], world_size=2, layouts=layouts)
    assert plan.flops == (3 * ns_flops(32, 32, 5), 4 * ns_flops(16, 8, 5))


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True])
def test_bad_world_size(world_size):
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        plan_ownership([(4, 4)], world_size=world_size)


def test_per_parameter_options_must_match_the_shapes():
    with pytest.raises(ValueError, match="one entry per shape"):
        plan_ownership([(4, 4), (4, 4)], world_size=2, layouts=[MatrixLayout()])


@pytest.mark.parametrize(
    ("shape", "split_sizes", "batched", "transposed"),
    [
        ((32, 16), (8, 4, 4), False, False),  # grouped QKV: 2 query groups of [q | k | v]
        ((16, 32), (8, 4, 4), False, True),  # the same, stored (fan_in, fan_out) as GPT-2's Conv1D
        ((96, 32), (32, 32, 32), False, False),
        ((8, 3, 3, 3), None, False, False),
        ((2, 4, 16, 8), None, True, False),
        ((4, 32, 16), (16, 16), True, False),  # Mixtral's gate_up: E experts of [gate | up]
        ((4, 16, 32), (1, 1), True, True),  # GPT-OSS's gate_up: (E, in, out), gate and up interleaved
    ],
)
def test_planning_counts_the_matrices_newton_schulz_sees(shape, split_sizes, batched, transposed):
    # The plan must cost what matrix_views hands to Newton-Schulz: for grouped QKV each piece
    # gathers its block from every query group, (groups * size_i, cols), not (size_i, cols).
    layout = MatrixLayout(split_sizes, batched, transposed)
    views = layout.views(torch.zeros(shape))
    expected = [tuple(m.shape[-2:]) for v in views for m in (v if v.ndim == 3 else [v])]
    assert matrix_shapes(shape, layout) == expected
    plan = plan_ownership([shape], 2, layouts=[layout])
    assert plan.flops == (sum(ns_flops(r, c, 5) for r, c in expected),)


def test_grouped_qkv_is_planned_by_its_whole_pieces():
    assert matrix_shapes((32, 16), MatrixLayout(split_sizes=(8, 4, 4))) == [(16, 16), (8, 16), (8, 16)]


def test_expert_blocks_rotate_so_that_no_rank_idles():
    # torch.chunk blocks per stack; stack k starts at rank (experts before it) mod W.
    assert expert_blocks([5, 5], 2) == [[(0, 3), (3, 2)], [(3, 2), (0, 3)]]
    # Fewer experts than ranks: the ranks one stack misses take the next stack's.
    blocks = expert_blocks([2, 2], 4)
    assert blocks == [[(0, 1), (1, 1), (2, 0), (3, 0)], [(2, 0), (3, 0), (0, 1), (1, 1)]]
    # Every expert of every stack on exactly one rank.
    for stack, count in zip(expert_blocks([7, 3, 8], 3), [7, 3, 8]):
        covered = sorted(e for start, rows in stack for e in range(start, start + rows))
        assert covered == list(range(count))


def test_spread_stacks_get_no_owner_and_weigh_on_their_ranks():
    layouts = [MatrixLayout(), MatrixLayout(batched=True)]
    blocks = expert_blocks([3], 2)  # rank 0 steps experts 0-1, rank 1 expert 2
    plan = plan_ownership([(8, 8), (3, 8, 8)], 2, layouts=layouts, spread=[False, True], spread_blocks=blocks)
    assert plan.owners == (1, -1)  # the dense matrix goes where fewer experts are
    unweighted = plan_ownership([(8, 8), (3, 8, 8)], 2, layouts=layouts, spread=[False, True])
    assert unweighted.owners == (0, -1)  # without the blocks: the tie's lower rank
    assert plan.flops == (ns_flops(8, 8, 5), 3 * ns_flops(8, 8, 5))
