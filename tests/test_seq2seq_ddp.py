"""The seq2seq example under DDP: real 2-process gloo runs of ``cli.py fit`` and ``cli.py predict``."""

import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from data import Seq2SeqDataModule
from tests.helpers import DDP_YAML, REPO, SINGLE_PROCESS, run_job, run_script

pytestmark = pytest.mark.distributed

SEQ2SEQ_YAML = str(REPO / "configs" / "seq2seq.yaml")
# A small corpus and model, so a run takes seconds.
SMALL_DATA = {"num_pairs": 330, "max_digits": 3, "val_fraction": 0.1, "batch_size": 16}
SMALL = [
    *(f"--data.init_args.{key}={value}" for key, value in SMALL_DATA.items()),
    "--model.init_args.d_model=32",
    "--model.init_args.num_encoder_layers=1",
    "--model.init_args.num_decoder_layers=1",
    "--model.init_args.dim_feedforward=64",
    "--model.init_args.warmup_steps=10",
]
# Sources in no particular order, one beyond the corpus range and one with a character the vocabulary lacks.
SOURCES = ["905", "12", "7", "x1", "123456", "40", "3"]
LAST = "logs/seq2seq/default/checkpoints/last.ckpt"


@pytest.fixture(scope="module")
def fit_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("seq2seq")
    _, records = run_job(
        workdir,
        "fit",
        "-c",
        DDP_YAML,
        "-c",
        SEQ2SEQ_YAML,
        *SMALL,
        "--trainer.accelerator=cpu",
        "--trainer.max_epochs=2",
        probe_options=("--trainer.callbacks.input_key=index",),
    )
    return workdir, records


@pytest.fixture(scope="module")
def predict_run(fit_run):
    workdir, _ = fit_run
    (workdir / "sources.txt").write_text("".join(f"{s}\n" for s in SOURCES))
    result = run_script(
        [
            str(REPO / "cli.py"),
            "predict",
            "-c",
            DDP_YAML,
            "-c",
            SEQ2SEQ_YAML,
            *SMALL,
            "--trainer.accelerator=cpu",
            "--trainer.logger=false",
            f"--ckpt_path={LAST}",
            "--data.init_args.predict_path=sources.txt",
            "--trainer.callbacks.output_path=out/predictions.tsv",
        ],
        cwd=workdir,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return workdir, result.stdout + result.stderr


def test_every_rank_built_the_same_vocabulary_and_the_checkpoint_holds_it(fit_run):
    workdir, records = fit_run
    vocabularies = [r["datamodule_state"]["vocab"] for r in records]
    assert [r["world_size"] for r in records] == [2, 2]
    assert vocabularies[0] == vocabularies[1]
    checkpoint = torch.load(workdir / "logs" / "seq2seq" / "default" / "checkpoints" / "last.ckpt")
    assert checkpoint["Seq2SeqDataModule"]["vocab"] == vocabularies[0]
    assert checkpoint["state_dict"]["embedding.weight"].size(0) == len(vocabularies[0])


def small_splits(workdir) -> dict[str, list]:
    data = Seq2SeqDataModule(**SMALL_DATA, data_dir=str(workdir / "cache"))
    data.setup("fit")
    return data.splits


def test_ranks_trained_on_disjoint_shards_of_the_training_split(fit_run):
    workdir, records = fit_run
    num_train = len(small_splits(workdir)["train"])
    first, second = (set(r["inputs"].tolist()) for r in records)
    assert len(records[0]["inputs"]) == len(records[1]["inputs"]) == math.ceil(num_train / 2)
    assert len(first | second) == num_train


def test_metrics_gathered_over_two_ranks_equal_a_single_process_evaluation(fit_run, run_cli):
    workdir, _ = fit_run
    # An odd count, which Lightning's default DistributedSampler would even out by repeating a pair.
    assert len(small_splits(workdir)["val"]) % 2 == 1
    events = EventAccumulator(str(workdir / "logs" / "seq2seq" / "default"))
    events.Reload()
    single = run_cli(
        "validate",
        "-c",
        DDP_YAML,
        "-c",
        SEQ2SEQ_YAML,
        *SMALL,
        *SINGLE_PROCESS,
        "--trainer.logger=false",
        f"--data.init_args.data_dir={workdir / 'cache'}",
        f"--ckpt_path={workdir / LAST}",
    )
    for name in ("val/loss", "val/token_acc", "val/exact_match"):
        gathered = events.Scalars(name)[-1].value
        assert gathered == pytest.approx(single.trainer.callback_metrics[name].item(), rel=1e-5), name
    assert events.Scalars("val/loss")[-1].value < events.Scalars("val/loss")[0].value


def test_predictions_are_written_once_in_input_order(predict_run, run_cli, tmp_path):
    workdir, output = predict_run
    written = (workdir / "out" / "predictions.tsv").read_text(encoding="utf-8")
    lines = written.splitlines()
    assert [line.split("\t")[0] for line in lines] == SOURCES
    assert all(line.count("\t") == 1 and line.split("\t")[1] for line in lines)
    assert output.count("Wrote 7 predictions to out/predictions.tsv") == 1
    assert [p.name for p in (workdir / "out").iterdir()] == ["predictions.tsv"]  # no temporary file left

    # One process with the same checkpoint predicts the same text for each source.
    run_cli(
        "predict",
        "-c",
        DDP_YAML,
        "-c",
        SEQ2SEQ_YAML,
        *SMALL,
        *SINGLE_PROCESS,
        "--trainer.logger=false",
        f"--ckpt_path={workdir / LAST}",
        f"--data.init_args.predict_path={workdir / 'sources.txt'}",
        "--trainer.callbacks.output_path=single.tsv",
    )
    assert (tmp_path / "single.tsv").read_text(encoding="utf-8") == written


def test_bad_input_stops_a_two_process_run_before_it_starts_with_one_message(tmp_path):
    (tmp_path / "pairs.jsonl").write_text('{"source": "1", "target": "one"}\n{"source": "2", "text": "two"}\n')
    result = run_script(
        [str(REPO / "cli.py"), "fit", "-c", DDP_YAML, "-c", SEQ2SEQ_YAML, "--data.init_args.path=pairs.jsonl"],
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert "error: data.path: pairs.jsonl:2: unknown field 'text'" in result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("error:") == 1
    assert not (tmp_path / "logs").exists()
