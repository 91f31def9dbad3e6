"""training.StayStopped: configs/seq2seq.yaml's end of a run, which a rerun of the same command keeps."""

import logging

from lightning.pytorch import Trainer

from data import RandomDataModule
from models import ToyModel
from training import StayStopped
from training.private_api import LIGHTNING_2_5


def fit(tmp_path, ckpt_path=None) -> Trainer:
    stop = StayStopped(monitor="val/loss", mode="min", stopping_threshold=1e9)  # met at the first validation
    trainer = Trainer(
        max_epochs=10,
        limit_train_batches=2,
        limit_val_batches=1,
        callbacks=[stop],
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = RandomDataModule(num_train=256, num_val=16, num_test=16)
    own_checkpoint = {} if LIGHTNING_2_5 else {"weights_only": False}  # 2.5 loads any checkpoint as a full pickle
    trainer.fit(ToyModel(), data, ckpt_path=ckpt_path, **own_checkpoint)
    return trainer


def test_a_run_it_stopped_trains_nothing_when_run_again_and_says_why(tmp_path, caplog):
    first = fit(tmp_path)
    assert first.global_step == 2, "the threshold did not stop the run after its first epoch"
    checkpoint = next((tmp_path / "checkpoints").glob("*.ckpt"))
    with caplog.at_level(logging.INFO):
        again = fit(tmp_path, ckpt_path=str(checkpoint))
    assert again.global_step == 2, "the rerun trained again"
    reason = "val/loss = " if LIGHTNING_2_5 else "Stopping threshold reached: val/loss = "  # 2.5 says none itself
    assert f"training.StayStopped had ended this run: {reason}" in caplog.text
