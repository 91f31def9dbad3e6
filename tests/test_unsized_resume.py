"""A run whose training data is an IterableDataset without a length (tests.zoo.Shards), stopped by SIGTERM part-way
through its second epoch on 2 CPU processes, and resumed by the same command: it ends at the step an uninterrupted
run ends at, and says in one line that the epoch starts again. Plain Lightning 2.6.6 says nothing and trains the
batches done before the stop once more on top."""

import signal

import pytest
import torch

from tests.helpers.one_node import PACE, ended, signalled_at, start, stop_line, traces

pytestmark = pytest.mark.distributed

STEPS_PER_EPOCH = 64  # 8 shards of 256 samples, 4 per rank, 16 per batch
STOP_STEP = STEPS_PER_EPOCH + 10
RUN = [
    "--data=tests.zoo.Shards",
    "--trainer.max_epochs=2",
    # Each step at least PACE long: the ranks agree on stopping within the epoch however fast the machine is.
    "--trainer.callbacks+=tests.helpers.probe.SlowDown",
    f"--trainer.callbacks.seconds={PACE}",
    "--trainer.callbacks.progress_file=progress.step",
]


def last_checkpoint(workdir) -> dict:
    return torch.load(workdir / "logs" / "toy" / "default" / "checkpoints" / "last.ckpt", weights_only=True)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("unsized")
    result = signalled_at(workdir, workdir / "hold", STOP_STEP, signal.SIGTERM, *RUN)
    return result | {"workdir": workdir, "checkpoint": last_checkpoint(workdir)}


@pytest.fixture(scope="module")
def resumed(stopped):
    result = ended(stopped["workdir"], start(stopped["workdir"], *RUN), within=600)
    return result | {"checkpoint": last_checkpoint(stopped["workdir"])}


def test_a_stop_part_way_through_an_epoch_of_unsized_data_saves_its_step(stopped):
    assert stopped["status"] == 0, stopped["output"]
    stop = stop_line(stopped["output"])
    assert stop[2] == "1" and STOP_STEP <= int(stop[3]) < 2 * STEPS_PER_EPOCH
    assert stopped["checkpoint"]["global_step"] == int(stop[3])


def test_the_resumed_run_ends_at_the_step_of_an_uninterrupted_one_and_says_the_epoch_starts_again(stopped, resumed):
    assert resumed["status"] == 0, resumed["output"]
    assert not traces(resumed["output"]), resumed["output"]
    done = stopped["checkpoint"]["global_step"] - STEPS_PER_EPOCH
    note = [line for line in resumed["output"].splitlines() if "starts again from its first batch" in line]
    assert note == [
        "Epoch 1 starts again from its first batch: the training data (an IterableDataset without a length, in a "
        "loader without state_dict) cannot continue part-way through an epoch. It ends after the "
        f"{STEPS_PER_EPOCH - done} batches it had left (the previous epoch had {STEPS_PER_EPOCH}), so the run ends at "
        "the step an uninterrupted one would. A loader with state_dict and load_state_dict continues where it stopped "
        "(data/resumable.py's EpochPosition keeps the trainer's count)."
    ], resumed["output"]
    assert resumed["checkpoint"]["global_step"] == 2 * STEPS_PER_EPOCH
    assert resumed["checkpoint"]["epoch"] == 1  # the last of max_epochs=2, not a third begun
    assert all(torch.isfinite(value).all() for value in resumed["checkpoint"]["state_dict"].values())
