"""The turn-growth test (pipeline/compare/turn_growth.py) on drift drawn as precision noise
draws it, with the tokens of one trajectory sharing their noise: its false-alarm rate at the
token counts of an 8-turn agent batch, growth of the precision floor itself left alone, and a
drift that grows from the second turn found."""

from __future__ import annotations

import numpy as np

from pipeline.compare.turn_growth import ALPHA, GROWTH, turn_growth

TRAJECTORIES, TURNS, TURN_TOKENS = 16, 8, 24


def batch(rng, scale_of_turn=lambda k: 1.0, icc: float = 0.3):
    """|d| per token in units of its floor (mean 1): a trajectory's share of noise and each
    token's own, lognormal like |d|; ``scale_of_turn`` multiplies turn k's tokens (0-based)."""
    turn = np.tile(np.repeat(np.arange(TURNS), TURN_TOKENS), TRAJECTORIES)
    n = len(turn)
    shared = np.repeat(rng.normal(0.0, np.sqrt(icc), TRAJECTORIES), TURNS * TURN_TOKENS)
    own = rng.normal(0.0, np.sqrt(1 - icc), n)
    units = np.exp(0.8 * (shared + own) - 0.32)  # mean 1
    units *= np.array([scale_of_turn(k) for k in range(TURNS)])[turn]
    offsets = np.arange(0, n + 1, TURNS * TURN_TOKENS)
    return turn, units, offsets


def test_noise_alone_raises_it_in_at_most_alpha_of_batches():
    rng = np.random.default_rng(0)
    found = sum(
        turn_growth(*batch(rng), expected=np.ones(TRAJECTORIES * TURNS * TURN_TOKENS)).found
        for _ in range(3000)
    )
    # ALPHA = 1e-3: 3 expected in 3,000; the level a finding also needs makes it rarer
    assert found <= 8, found


def test_the_floor_growing_with_the_context_is_not_a_finding():
    """bf16 against bf16 on the tiny model: 0.17x its floor at turn 1, 0.26x at turn 8, a
    significant slope, and precision all the same."""
    rng = np.random.default_rng(1)
    n = TRAJECTORIES * TURNS * TURN_TOKENS
    test = turn_growth(*batch(rng, lambda k: 0.17 * (1 + 0.1 * k), icc=0.05), expected=np.ones(n))
    assert test.p < ALPHA and test.growth >= GROWTH  # it grows,
    assert not test.found  # but stays under its floor


def test_a_drift_that_builds_up_from_the_second_turn_is_found_naming_it():
    rng = np.random.default_rng(2)
    n = TRAJECTORIES * TURNS * TURN_TOKENS
    hits = [turn_growth(*batch(rng, lambda k: 1.0 + 0.5 * k), expected=np.ones(n))
            for _ in range(200)]  # fmt: skip
    found = [t for t in hits if t.found]
    assert len(found) >= 197  # power >= 98.5 % at 16 trajectories (measured 199 of 200)
    assert {t.first_grown_turn() for t in found} <= {2, 3}
    assert all(3.0 < t.growth < 6.0 for t in found)


def test_a_drift_that_starts_at_the_second_turn_and_stays_is_found_as_a_step():
    """A session resumed with the tool turn mishandled: turn 1 clean, every later turn at 2x."""
    rng = np.random.default_rng(5)
    n = TRAJECTORIES * TURNS * TURN_TOKENS
    hits = [turn_growth(*batch(rng, lambda k: 1.0 if k == 0 else 2.0), expected=np.ones(n))
            for _ in range(200)]  # fmt: skip
    found = [t for t in hits if t.found]
    assert len(found) >= 188  # power >= 94 % for a 2x step (measured 194 of 200)
    assert {t.first_grown_turn() for t in found} == {2}


def test_without_a_calibration_the_last_turn_must_pass_the_profiles_limit():
    rng = np.random.default_rng(3)
    turn, units, offsets = batch(rng, lambda k: 1.0 + 0.5 * k)
    assert turn_growth(turn, units * 0.01, offsets, limit=0.03).found  # 0.045 at turn 8
    assert not turn_growth(turn, units * 0.001, offsets, limit=0.03).found  # 0.0045
    assert turn_growth(turn, units, offsets) is None  # no level to judge against


def test_too_few_trajectories_or_turns_test_nothing():
    rng = np.random.default_rng(4)
    turn, units, offsets = batch(rng)
    three = offsets[2] + 1
    assert turn_growth(turn[:three], units[:three], [0, offsets[1], three], limit=1.0) is None
    assert turn_growth(np.minimum(turn, 1), units, offsets, limit=1.0) is None
