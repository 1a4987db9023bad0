"""Data sources at scale and under validation: the Markov chain's memory is O(vocab x branching),
token files are checked id by id before training, in parts (one per rank)."""

import tracemalloc

import numpy as np
import pytest

from hyper_parallel.data import MarkovSource, TokenWindows


def test_markov_loss_floor_does_not_allocate_vocab_squared():
    source = MarkovSource(8192, 8, seed=3)  # a vocab x vocab matrix of doubles would be 512 MiB
    tracemalloc.start()
    try:
        source.loss_floor()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * MarkovSource.memory_bytes(8192, 4), peak


def test_markov_loss_floor_equals_the_dense_computation():
    source = MarkovSource(50, 7, seed=4, branching=3)
    dense = np.zeros((50, 50))
    np.add.at(dense, (np.arange(50)[:, None], source.successors), source.probs)
    entropy = -(source.probs * np.log(source.probs)).sum(axis=1)
    marginal, total = np.full(50, 1 / 50), 0.0
    for _ in range(7):
        total += marginal @ entropy
        marginal = marginal @ dense
    assert source.loss_floor() == pytest.approx(total / 7, rel=1e-12)


@pytest.mark.parametrize("bad_at", [0, 1, 499, 500, 998])
def test_token_ids_are_validated_in_parts(bad_at):
    tokens = np.zeros(999, dtype=np.uint16)
    tokens[bad_at] = 100
    source = TokenWindows(tokens, 8, 100, name="t.bin")
    failing = []
    for part in range(2):
        try:
            source.validate(part, 2)
        except ValueError as err:
            failing.append(part)
            assert str(err) == f"t.bin: token id 100 is outside the model's vocab_size=100 (token {bad_at} of 999)"
    assert failing == [0 if bad_at < 499 else 1]
    TokenWindows(tokens, 8, 101).validate(0, 1)
