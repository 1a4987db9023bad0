"""Token sources and the loader: determinism, exact loss floor, resume across world sizes."""

import math

import numpy as np
import pytest
import torch

from hyper_parallel.data import (ByteTokenizer, DistributedBatchLoader, MarkovSource, TokenWindows,
                                 build_source, read_text_tokens)


def _global_batches(source, gbs, world, steps, *, resume_at=None, new_world=None, shuffle=True):
    """Concatenate every rank's slices per step, optionally saving and resuming on another world."""
    loaders = [DistributedBatchLoader(source, gbs, dp_rank=r, dp_size=world, seed=3, shuffle=shuffle)
               for r in range(world)]
    out = []
    for step in range(steps):
        if step == resume_at:
            saved = loaders[0].state_dict()
            loaders = [DistributedBatchLoader(source, gbs, dp_rank=r, dp_size=new_world, seed=3, shuffle=shuffle)
                       for r in range(new_world)]
            for loader in loaders:
                loader.load_state_dict(saved)
        out.append(torch.cat([loader.next_batch() for loader in loaders]))
    return out


@pytest.mark.parametrize("make_source", [
    lambda: MarkovSource(32, 8, seed=1),
    lambda: TokenWindows(np.arange(1000) % 50, 8, 50),  # 124 samples: epochs wrap inside a run
])
@pytest.mark.parametrize("world,new_world", [(2, 4), (4, 1), (1, 2)])
def test_resume_on_another_world_size_sees_the_same_batches(make_source, world, new_world):
    source = make_source()
    reference = _global_batches(source, 8, 1, 20)
    resumed = _global_batches(source, 8, world, 20, resume_at=7, new_world=new_world)
    for step, (a, b) in enumerate(zip(reference, resumed)):
        assert torch.equal(a, b), f"global batch {step} differs"


def test_finite_source_epochs_cover_every_sample_once_in_a_new_order():
    source = TokenWindows(np.arange(81), 4, 100)  # 20 samples
    batches = _global_batches(source, 5, 1, 8)
    epoch0 = torch.cat(batches[:4])[:, 0].tolist()
    epoch1 = torch.cat(batches[4:])[:, 0].tolist()
    assert sorted(epoch0) == sorted(epoch1) == list(range(0, 80, 4))
    assert epoch0 != epoch1
    unshuffled = torch.cat(_global_batches(source, 5, 1, 4, shuffle=False))[:, 0].tolist()
    assert unshuffled == list(range(0, 80, 4))


def test_windows_share_their_boundary_token():
    source = TokenWindows(np.arange(20), 4, 100)
    assert source.samples([0, 1]).tolist() == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]]


def test_markov_samples_are_a_function_of_the_index_only():
    source = MarkovSource(64, 16, seed=5)
    both = source.samples([3, 9])
    assert torch.equal(both[1], source.samples([9])[0])
    assert not torch.equal(both[0], both[1])
    assert torch.equal(MarkovSource(64, 16, seed=5).samples([3]), both[:1])
    # every transition is one the chain allows
    for row in both.tolist():
        for a, b in zip(row, row[1:]):
            assert b in source.successors[a]


def test_markov_loss_floor_matches_the_empirical_entropy():
    source = MarkovSource(16, 12, seed=2, branching=3)
    tokens = source.samples(range(4000)).numpy()
    log_p = []
    for a, b in zip(tokens[:, :-1].ravel(), tokens[:, 1:].ravel()):
        (k,) = np.nonzero(source.successors[a] == b)[0]
        log_p.append(math.log(source.probs[a, k]))
    empirical = -float(np.mean(log_p))
    assert source.loss_floor() == pytest.approx(empirical, rel=0.03)
    assert 0 < source.loss_floor() < math.log(3)


def test_text_and_token_files(tmp_path):
    (tmp_path / "a.txt").write_text("héllo")
    (tmp_path / "b.txt").write_text("world")
    tokens = read_text_tokens(str(tmp_path / "*.txt"), ByteTokenizer())
    assert ByteTokenizer().decode(tokens) == "héllo\n\nworld"
    path = tmp_path / "tok.bin"
    np.arange(300, dtype=np.uint32).tofile(path)
    source = build_source("tokens", seq_len=10, vocab_size=400, seed=0, path=str(path), dtype="uint32")
    assert source.num_samples == 29 and source.samples([2]).tolist() == [list(range(20, 31))]


def test_bad_data_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such data file"):
        build_source("text", seq_len=4, vocab_size=256, seed=0, paths=str(tmp_path / "missing.txt"))
    path = tmp_path / "tok.bin"
    np.arange(300, dtype=np.uint16).tofile(path)
    source = build_source("tokens", seq_len=10, vocab_size=100, seed=0, path=str(path), dtype="uint16")
    with pytest.raises(ValueError, match="outside the model's vocab_size=100"):
        source.samples([20])
    with pytest.raises(ValueError, match="fewer than one sample"):
        TokenWindows(np.arange(4), 8, 100)
    with pytest.raises(ValueError, match="not divisible by 3"):
        DistributedBatchLoader(source, 8, dp_rank=0, dp_size=3)
    loader = DistributedBatchLoader(source, 8)
    with pytest.raises(ValueError, match="global_batch_size: saved 4"):
        loader.load_state_dict({**loader.state_dict(), "global_batch_size": 4})


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_micro_step_holds_the_same_rows_on_any_number_of_ranks(world):
    # 8 samples, 2 micro-batches: micro-step m of every layout is rows 4m..4m+3 of the global batch
    # (what a mixture of experts balances together), the ranks' parts in rank order.
    source = MarkovSource(32, 8, seed=1)
    whole = DistributedBatchLoader(source, 8, seed=3).next_batch()
    slices = [DistributedBatchLoader(source, 8, dp_rank=r, dp_size=world, seed=3, micro_batches=2).next_batch()
              for r in range(world)]
    for m in range(2):
        micro_step = torch.cat([part.chunk(2)[m] for part in slices])
        assert torch.equal(micro_step, whole[4 * m:4 * m + 4]), (world, m)
    message = "global_batch_size=8 is not divisible by 4 data-parallel ranks x 4 micro-batches"
    with pytest.raises(ValueError, match=message):
        DistributedBatchLoader(source, 8, dp_size=4, micro_batches=4)
