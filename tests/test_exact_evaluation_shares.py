"""training/exact_evaluation.py without processes: which evaluation loaders lose their padding, the shares they deal
out, and the line for a set whose unpadded shares would need different numbers of batches."""

from types import SimpleNamespace

import pytest
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

from training.exact_evaluation import ExactEvaluation


class Lightnings:
    def process_dataloader(self, dataloader: object) -> object:
        return dataloader


class Strategy(ExactEvaluation, Lightnings):
    def __init__(self, stage: RunningStage, exact_evaluation: bool = True) -> None:
        self.exact_evaluation = exact_evaluation
        self.is_global_zero = True
        self.lightning_module = SimpleNamespace(trainer=SimpleNamespace(state=SimpleNamespace(stage=stage)))


def shares(samples: int, batch_size: int, stage: RunningStage, exact: bool = True, **loader) -> list[list[int]]:
    """What each of 2 processes evaluates of ``samples`` numbered samples, as Lightning's sampler would deal them."""
    dealt = []
    for rank in range(2):
        sampler = DistributedSampler(range(samples), num_replicas=2, rank=rank, shuffle=False)
        data = DataLoader(range(samples), batch_size=batch_size, sampler=sampler, **loader)
        data = Strategy(stage, exact).process_dataloader(data)
        assert len(data) == len(list(data)), "the loader's length is not what it yields"
        dealt.append([int(i) for batch in data for i in batch])
    return dealt


@pytest.mark.parametrize("stage", [RunningStage.SANITY_CHECKING, RunningStage.VALIDATING, RunningStage.TESTING])
def test_an_evaluation_deals_each_sample_once_where_every_process_runs_as_many_batches(stage):
    dealt = shares(11, 4, stage)
    assert sorted(dealt[0] + dealt[1]) == list(range(11))
    assert [len(share) for share in dealt] == [6, 5]


def test_training_and_a_switched_off_evaluation_keep_lightnings_padded_shares():
    padded = [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 0]]
    assert shares(11, 4, RunningStage.TRAINING) == padded
    assert shares(11, 4, RunningStage.TESTING, exact=False) == padded


def test_shares_that_would_need_different_numbers_of_batches_stay_padded_and_say_so(capsys):
    # 9 numbers in batches of 4: shares of 5 and 4 would be 2 batches and 1, and a collective in the second
    # batch of rank 0 would wait for rank 1 for good.
    dealt = shares(9, 4, RunningStage.VALIDATING)
    assert [len(share) for share in dealt] == [5, 5]
    assert capsys.readouterr().out.splitlines()[0] == (
        "validation: 9 samples on 2 processes in batches of 4 cannot be shared without repeats so that every "
        "process runs as many batches as the others (shares of 5 and 4 samples), which a collective inside a step "
        "needs; so Lightning's padded shares stay, and 1 sample is evaluated and counted twice. For exact figures, "
        "choose a batch size that gives every share the same number of batches, or run the validation on one process."
    )
    dealt = shares(9, 3, RunningStage.VALIDATING)  # 5 and 4 are 2 batches each
    assert (sorted(dealt[0] + dealt[1]), capsys.readouterr().out) == (list(range(9)), "")


def test_a_loader_that_drops_its_last_short_batch_is_counted_by_the_batches_it_runs():
    # 11 in batches of 3: shares of 6 and 5 are 2 batches each, but 2 and 1 without the short last batch.
    assert [len(share) for share in shares(11, 3, RunningStage.TESTING)] == [6, 5]
    assert [len(share) for share in shares(11, 3, RunningStage.TESTING, drop_last=True)] == [6, 6]


def test_a_sampler_of_the_users_own_that_deals_its_indices_its_own_way_is_left_alone():
    class EveryOther(DistributedSampler):
        def __iter__(self):
            return iter(range(self.rank, self.total_size, 2))

    sampler = EveryOther(range(11), num_replicas=2, rank=1, shuffle=False)
    data = Strategy(RunningStage.TESTING).process_dataloader(DataLoader(range(11), batch_size=4, sampler=sampler))
    assert (data.sampler.total_size, len(data)) == (12, 2)


def test_lightnings_wrapper_around_a_sampler_of_the_users_deals_each_sample_once():
    dealt = []
    for rank in range(2):
        sampler = DistributedSamplerWrapper(SequentialSampler(range(11)), num_replicas=2, rank=rank, shuffle=False)
        data = Strategy(RunningStage.VALIDATING).process_dataloader(
            DataLoader(range(11), batch_size=4, sampler=sampler)
        )
        dealt.append([int(i) for batch in data for i in batch])
    assert sorted(dealt[0] + dealt[1]) == list(range(11))
