"""Samplers, without the model: reproducible draws and the filters."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.records import Sampler
from kvsp.instance.sampling import draw, next_token


def test_draws_depend_only_on_seed_and_step() -> None:
    assert draw(7, 3) == draw(7, 3)
    assert draw(7, 3) != draw(7, 4)
    assert draw(7, 3) != draw(8, 3)
    assert 0 <= draw(0, 0) < 1


def test_greedy_takes_the_lowest_id_on_ties() -> None:
    assert next_token(np.array([1.0, 3.0, 3.0, 2.0]), Sampler(method="greedy"), 0) == 1


def test_top_k_1_is_greedy_and_top_p_keeps_the_head() -> None:
    logits = np.array([0.0, 5.0, 1.0, 4.9])
    assert next_token(logits, Sampler(method="top-k", params={"k": 1}, seed=1), 9) == 1
    tiny_p = Sampler(method="top-p", params={"p": 0.01}, seed=3)
    assert all(next_token(logits, tiny_p, n) == 1 for n in range(50))


@given(
    st.lists(st.floats(-20, 20), min_size=2, max_size=50),
    st.integers(0, 2**32),
    st.integers(0, 10_000),
)
def test_choices_are_reproducible_and_in_range(logits: list[float], seed: int, step: int) -> None:
    values = np.array(logits)
    for sampler in (
        Sampler(method="temperature", params={"temperature": 0.7}, seed=seed),
        Sampler(method="top-k", params={"k": 3}, seed=seed),
        Sampler(method="top-p", params={"p": 0.8}, seed=seed),
    ):
        token = next_token(values, sampler, step)
        assert 0 <= token < len(values)
        assert token == next_token(values.copy(), sampler, step)
