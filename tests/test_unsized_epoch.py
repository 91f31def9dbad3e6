"""training.UnsizedEpochResume in one process: a run resumed part-way through an epoch of tests.zoo.Shards (an
IterableDataset without a length) from a checkpoint saved there, against the same run uninterrupted."""

import warnings

import pytest
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from models import ToyModel
from tests.zoo import Shards
from training.checkpoints.unsized_epoch import UnsizedEpochResume

BATCHES = 8  # 2 shards of 32 samples, 8 per batch
DATA = {"num_shards": 2, "shard_size": 32, "batch_size": 8}


class ValidatedShards(Shards):
    """Shards with a validation loader: validation runs at each epoch's end."""

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()


class StatefulShards(Shards):
    """Shards in a loader that keeps its place (here: none) in the checkpoint, as torchdata's StatefulDataLoader."""

    def train_dataloader(self) -> DataLoader:
        class Stateful(DataLoader):
            def state_dict(self) -> dict:
                return {}

            def load_state_dict(self, state: dict) -> None:
                pass

        loader = super().train_dataloader()
        return Stateful(loader.dataset, batch_size=loader.batch_size)


class CountingShards(Shards):
    """Shards in a loader that saves how many batches it yielded and skips as many on resume, as torchdata's
    StatefulDataLoader does for a dataset without a state of its own."""

    def train_dataloader(self) -> DataLoader:
        class Counting(DataLoader):
            yielded = skip = 0

            def __iter__(self):
                skip, self.skip, self.yielded = self.skip, 0, 0
                for index, batch in enumerate(super().__iter__()):
                    self.yielded = index + 1
                    if index >= skip:
                        yield batch

            def state_dict(self) -> dict:
                return {"yielded": self.yielded}

            def load_state_dict(self, state: dict) -> None:
                self.skip = state["yielded"]

        loader = super().train_dataloader()
        return Counting(loader.dataset, batch_size=loader.batch_size)


class Interrupt(Exception):
    pass


class SaveAndStop(Callback):
    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            raise Interrupt


class Validations(Callback):
    def __init__(self) -> None:
        self.at_steps = []

    def on_validation_end(self, trainer, pl_module) -> None:
        self.at_steps.append(trainer.global_step)


def fit(data_dir, data=ValidatedShards, stop_at=None, ckpt_path=None, plain=False) -> tuple[Trainer, list[int]]:
    validations = Validations()
    callbacks = [validations] if plain else [UnsizedEpochResume(), validations]
    if stop_at is not None:
        callbacks.append(SaveAndStop(stop_at, str(data_dir / "stopped.ckpt")))
    trainer = Trainer(
        max_epochs=3,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    data_module = data(data_dir=str(data_dir / "shards"), **DATA)
    trainer.fit(ToyModel(in_features=8, out_features=1), datamodule=data_module, ckpt_path=ckpt_path)
    return trainer, validations.at_steps


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return fit(tmp_path_factory.mktemp("uninterrupted"))


def resumed(tmp_path, stop_at: int, data=ValidatedShards, plain=False) -> tuple[Trainer, list[int]]:
    with pytest.raises(Interrupt):
        fit(tmp_path, data, stop_at=stop_at, plain=plain)
    return fit(tmp_path, data, ckpt_path=str(tmp_path / "stopped.ckpt"), plain=plain)


def test_plain_lightning_trains_the_batches_done_before_the_stop_once_more_and_says_nothing(tmp_path, uninterrupted):
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        trainer, _ = resumed(tmp_path, BATCHES + 3, plain=True)
    assert trainer.global_step == uninterrupted[0].global_step + 3
    assert not [warning for warning in warned if "before the epoch ended" in str(warning.message)]


def test_a_run_resumed_in_its_second_epoch_ends_and_validates_at_the_steps_of_an_uninterrupted_one(
    tmp_path, uninterrupted, caplog
):
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        trainer, validations = resumed(tmp_path, BATCHES + 3)
    assert not [warning for warning in warned if "before the epoch ended" in str(warning.message)]  # one line only
    assert uninterrupted[0].global_step == 3 * BATCHES
    assert trainer.global_step == uninterrupted[0].global_step
    assert trainer.current_epoch == uninterrupted[0].current_epoch
    assert validations == uninterrupted[1][1:]
    assert f"It ends after the {BATCHES - 3} batches it had left (the previous epoch had {BATCHES})" in caplog.text


def test_a_run_resumed_in_its_first_epoch_says_how_many_batches_more_it_trains(tmp_path, uninterrupted, caplog):
    trainer, _ = resumed(tmp_path, 3)
    assert trainer.global_step == uninterrupted[0].global_step + 3
    assert "Epoch 0 starts again from its first batch" in caplog.text
    assert "this run trains 3 batches more than an uninterrupted one would" in caplog.text


def test_a_loader_that_keeps_its_place_is_left_to_lightning(tmp_path, caplog):
    resumed(tmp_path, BATCHES + 3, StatefulShards)
    assert "starts again" not in caplog.text


def test_a_loader_that_counts_the_batches_it_yielded_resumes_one_batch_late(tmp_path, uninterrupted):
    # Lightning reads a loader without a length one batch ahead: the checkpoint's count includes a batch no step
    # trained (docs/fault-tolerance.md, Exact resumes).
    trainer, _ = resumed(tmp_path, BATCHES + 3, CountingShards)
    assert trainer.global_step == uninterrupted[0].global_step - 1
