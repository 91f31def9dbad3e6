"""A real 2-process DDP run on gloo, started the way a user starts it: ``python cli.py fit -c configs/ddp.yaml``."""

import os
import re
import shutil

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from data import RandomDataModule
from models import ToyModel
from tests.helpers import DDP_YAML, REPO, run_job, run_script

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ddp")
    output, records = run_job(
        workdir,
        "fit",
        "-c",
        DDP_YAML,
        "--trainer.accelerator=cpu",
        "--trainer.max_epochs=3",
        "--trainer.log_every_n_steps=8",
    )
    return workdir, output, records


def test_two_processes_registered_on_gloo(ddp_run):
    _, output, records = ddp_run
    assert "Process group started: gloo, 2 processes, timeout 0:30:00." in output
    assert [r["global_rank"] for r in records] == [0, 1]
    assert all(r["world_size"] == 2 and r["backend"] == "gloo" for r in records)


def test_each_process_gets_its_share_of_the_cores(ddp_run):
    _, _, records = ddp_run
    cores = len(os.sched_getaffinity(0))
    # Lightning's default, unless the user set OMP_NUM_THREADS (tests/test_launcher.py sets it).
    expected = int(os.environ.get("OMP_NUM_THREADS", max(1, cores // 2)))
    assert [r["threads"] for r in records] == [expected, expected]


def test_ranks_saw_disjoint_shards_covering_the_training_data(ddp_run):
    _, _, records = ddp_run
    data = RandomDataModule()
    data.setup("fit")
    train_x = data.splits["train"].tensors[0]
    index_of = {row.numpy().tobytes(): i for i, row in enumerate(train_x)}
    shards = []
    for record in records:
        indices = [index_of[row.numpy().tobytes()] for row in record["inputs"]]
        assert len(indices) == len(set(indices)), "a rank saw a sample twice in one epoch"
        shards.append(set(indices))
    assert not shards[0] & shards[1]
    assert shards[0] | shards[1] == set(range(len(train_x)))


def test_parameters_are_identical_on_every_rank(ddp_run):
    _, _, records = ddp_run
    first, second = (r["params"] for r in records)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_the_loss_fell(ddp_run):
    workdir, _, _ = ddp_run
    events = EventAccumulator(str(workdir / "logs" / "toy" / "default"))
    events.Reload()
    train = [e.value for e in events.Scalars("train/loss")]
    val = [e.value for e in events.Scalars("val/loss")]
    assert len(val) == 3
    assert train[-1] < 0.2 * train[0]
    assert val[-1] < val[0]


def test_outputs_were_written_once_by_rank_zero(ddp_run):
    workdir, _, records = ddp_run
    written = sorted(p.relative_to(workdir).as_posix() for p in workdir.rglob("*") if p.is_file())
    expected = [
        r"config\.yaml",
        r"hparams\.yaml",
        rf"events\.out\.tfevents\.\d+\.[^/]+\.{records[0]['pid']}\.0",  # the pid shows rank 0 wrote it
        r"checkpoints/last\.ckpt",
        r"checkpoints/epoch\d{3}-val_loss\d\.\d{4}\.ckpt",
    ]
    run_files = [p for p in written if not p.startswith("probe/")]
    assert len(run_files) == len(expected), run_files
    for pattern in expected:
        matches = [p for p in run_files if re.fullmatch(rf"logs/toy/default/{pattern}", p)]
        assert len(matches) == 1, (pattern, run_files)


def test_predict_writes_every_prediction_once_in_input_order(ddp_run, tmp_path):
    workdir, _, _ = ddp_run
    shutil.copytree(workdir / "logs", tmp_path / "logs")
    run = tmp_path / "logs" / "toy" / "default"
    # 1001 inputs: the distributed sampler pads the second process's share with a repeated one.
    arguments = ["predict", "-c", DDP_YAML, "--trainer.accelerator=cpu", "--data.init_args.num_test=1001"]
    result = run_script([str(REPO / "cli.py"), *arguments], cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"Predicting with the weights of {run / 'checkpoints' / 'last.ckpt'} (epoch 2, step 192)." in output
    assert output.count("Wrote 1001 predictions to logs/toy/default/predictions.pt") == 1

    data = RandomDataModule(num_test=1001)
    data.setup("predict")
    model = ToyModel(data.num_features, out_features=data.num_targets).eval()
    model.load_state_dict(torch.load(run / "checkpoints" / "last.ckpt")["state_dict"])
    with torch.no_grad():
        expected = model(data.splits["test"].tensors[0])
    torch.testing.assert_close(torch.load(run / "predictions.pt"), expected)
