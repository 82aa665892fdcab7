"""BlockPool.free_runs: one pass that leaves the free list and references exactly as one free() per run would."""
import pytest
import torch

from systems.engine.block_pool import BlockPool


def _pair(shared: bool):
    pools = [BlockPool(40, 64, "device") for _ in range(2)]
    for pool in pools:
        pool.alloc(30)
        if shared:
            pool.share(torch.tensor([5, 9]))
    return pools


@pytest.mark.parametrize("shared", [False, True])
def test_free_runs_equals_one_free_per_run(shared):
    ids = torch.tensor([7, 3, 12, 5, 9, 20, 1, 5, 9])
    runs = torch.tensor([0, 0, 0, 2, 2, 2, 5, 7, 7])
    if not shared:                     # unshared blocks are freed once each
        ids, runs = ids[:7], runs[:7]
    one_pass, per_run = _pair(shared)
    one_pass.free_runs(ids, runs)
    for r in runs.unique_consecutive().tolist():
        per_run.free(ids[runs == r])
    assert one_pass.num_free == per_run.num_free and one_pass.num_shared == per_run.num_shared
    assert torch.equal(one_pass._stack[:one_pass.num_free], per_run._stack[:per_run.num_free])
    assert torch.equal(one_pass.refs, per_run.refs)


def test_free_runs_refuses_free_blocks_and_unsorted_runs():
    pool, _ = _pair(False)
    with pytest.raises(ValueError, match="ascending"):
        pool.free_runs(torch.tensor([1, 2]), torch.tensor([3, 1]))
    with pytest.raises(RuntimeError, match="already-free"):
        pool.free_runs(torch.tensor([1, 35]), torch.tensor([0, 1]))      # block 35 was never allocated
    with pytest.raises(ValueError, match="one run value per block"):
        pool.free_runs(torch.tensor([1, 2]), torch.tensor([0]))
    assert pool.num_free == 9 and int(pool.refs.sum()) == 30              # nothing changed
