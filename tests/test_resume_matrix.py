"""Every algorithm resumes exactly under every strategy: the resume matrix.

One small model routes a lane to each of the 14 built-in algorithms (``resume_modules.Lanes``),
so one fit per strategy and world size covers them all. A 2-rank fit under ``muon_ddp`` (one
file) and one under ``muon_fsdp`` (a folder, also converted to one file) save at steps 2 and
4; every other fit resumes one of them and runs to step 4: under ``"auto"``, ``muon_ddp`` and
``muon_fsdp``, at 1, 2 and 3 ranks (``resume_modules.RESUMES``). Three launches in all (2, 1
and 3 ranks), about 20 s on 2 cores.

Each result is compared with the uninterrupted one-process fit, lane by lane, to what float32
rounding makes of that lane's algorithm: the same fit with each batch summed in the other
order (the reordering control) moves each lane by some amount, and a fit agrees when no lane
is further off than 4 times that, or 1e-6 (a few ulps of these weights). SOAP and REKLS turn
rounding into differences as large as their 4-step displacement at their default eps; the
matrix takes them at the eps that tames that (``resume_modules.TAMED``), and
``test_soap_and_rekls_amplify_rounding_their_eps_tames_it`` measures both.
"""

from __future__ import annotations

import pytest
import torch
from resume_modules import (
    AMPLIFIERS,
    MATRIX,
    RESUMES,
    STEPS,
    initial_weights,
    lane_algorithms,
    lane_of,
    largest_difference,
    resume_tag,
    run_matrix,
    saved,
)

pytestmark = [pytest.mark.distributed, pytest.mark.policy_free, pytest.mark.slow]  # see conftest.py

ROUNDING = 4.0  # times the reordering control: measured at most 2.0 over the matrix's fits
FLOOR = 1e-6  # a lane the control moves by an ulp or two


def _lanes(params: dict[str, torch.Tensor]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name in params:
        out.setdefault(lane_of(name), []).append(name)
    return out


def _tolerances(runs: dict, tag: str = "one") -> dict[int, float]:
    """Per lane: ROUNDING x what summing each batch in the other order does to it, at least FLOOR."""
    reference, control = runs[tag]["params"], runs[f"{tag} reversed"]["params"]
    return {
        lane: max(ROUNDING * largest_difference(control, reference, names), FLOOR)
        for lane, names in _lanes(reference).items()
    }


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_matrix")
    runs = run_matrix(root)
    # The weights each step-4 checkpoint holds (the folder's through its one-file conversion).
    final = {
        source: torch.load(saved(root, source, STEPS), map_location="cpu", weights_only=False)["state_dict"]
        for source in ("muon_ddp", "converted")
    }
    return runs, final


def _assert_like_the_uninterrupted_run(runs: dict, tags: list[str], reference: str = "one") -> None:
    tolerances = _tolerances(runs, reference)
    expected = runs[reference]["params"]
    for tag in tags:
        assert runs[tag]["global_step"] == STEPS, tag
        got = runs[tag]["params"]
        assert got.keys() == expected.keys(), tag
        for lane, names in _lanes(expected).items():
            difference = largest_difference(got, expected, names)
            assert difference <= tolerances[lane], (
                f"{tag}: lane {lane} {lane_algorithms(lane)} is {difference:.2e} from the uninterrupted run, "
                f"over {tolerances[lane]:.2e}"
            )


def test_the_weights_moved(matrix):
    """Each lane moved far beyond its tolerance: the comparisons below can tell a wrong step."""
    runs, _ = matrix
    tolerances = _tolerances(runs)
    start, end = initial_weights(), runs["one"]["params"]
    for lane, names in _lanes(end).items():
        assert largest_difference(end, start, names) > 100 * tolerances[lane], lane_algorithms(lane)


def test_two_ranks_equal_one_process(matrix):
    runs, _ = matrix
    _assert_like_the_uninterrupted_run(runs, ["muon_ddp", "muon_fsdp"])


@pytest.mark.parametrize(("strategy", "world"), list(RESUMES))
def test_resume_continues_like_the_uninterrupted_run(matrix, strategy, world):
    """Step 2 of the muon_ddp file, the muon_fsdp folder or the folder's conversion, resumed to step 4."""
    runs, _ = matrix
    _assert_like_the_uninterrupted_run(runs, [resume_tag(strategy, world, s) for s in RESUMES[strategy, world][0]])


def test_resume_at_the_same_world_size_is_bit_exact(matrix):
    """muon_ddp from its file and muon_fsdp from its folder, at 2 ranks: the saving fit's weights, every bit."""
    runs, _ = matrix
    for strategy in ("muon_ddp", "muon_fsdp"):
        resumed, uninterrupted = runs[resume_tag(strategy, 2, strategy)]["params"], runs[strategy]["params"]
        different = [n for n, w in uninterrupted.items() if not torch.equal(resumed[n], w)]
        assert different == [], f"{strategy}: {different}"


def test_resume_with_max_steps_reached_hands_back_the_checkpoint(matrix):
    """Loading a step-4 checkpoint with max_steps=4 trains nothing, and changes no weight by a bit."""
    runs, final = matrix
    tags = [(resume_tag(st, w, s, done=True), s) for (st, w), (_, done) in RESUMES.items() for s in done]
    assert len(tags) == 5
    for tag, source in tags:
        assert runs[tag]["global_step"] == STEPS, tag
        checkpoint = final["converted" if source == "muon_fsdp" else source]
        different = [n for n, w in checkpoint.items() if not torch.equal(runs[tag]["params"][n], w)]
        assert different == [], f"{tag}: {different}"


def test_soap_and_rekls_amplify_rounding_their_eps_tames_it(matrix):
    """At their default eps (1e-8) SOAP and REKLS move their weights by a sizeable part of the training's
    own displacement when a batch is summed in another order; with TAMED's eps, 100 times less or more.
    At the default eps too, 2 ranks equal one process to what that reordering does."""
    runs, _ = matrix
    default, tamed = _tolerances(runs, "one default eps"), _tolerances(runs, "one")
    others = max(tol for lane, tol in default.items() if MATRIX[lane] not in AMPLIFIERS)
    for algorithm in AMPLIFIERS:
        lane = MATRIX.index(algorithm)
        assert default[lane] > 100 * others, algorithm
        assert default[lane] > 100 * tamed[lane], algorithm
    _assert_like_the_uninterrupted_run(runs, ["muon_ddp default eps"], reference="one default eps")
