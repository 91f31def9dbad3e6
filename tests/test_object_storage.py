"""logs/ in an object store: a 2-process run writing to an S3 bucket (moto's S3 server on loopback, in a process of
its own that outlives the job), killed, resumed by the same command from the bucket, then validated, tested and
predicted from the checkpoint there; a run resumed from its best checkpoint keeps that file; last.ckpt there is the
latest state when the monitored metric stops improving. s3fs and moto come from requirements-s3-tests.txt, on the
PYTHONPATH of this file's processes alone (tests.helpers.s3_path)."""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem

from tests.helpers import (
    DDP_YAML,
    REPO,
    SINGLE_PROCESS,
    free_port,
    probe_args,
    probe_records,
    run_script,
    s3_path,
    serve,
    wait_for_hold,
)
from training.checkpoints.atomic_io import AtomicCheckpointIO
from training.run.storage import storage_problem

BUCKET = "runs"
LOGS = f"s3://{BUCKET}/logs"
RUN = f"{LOGS}/toy/default"
STEPS = 8  # training steps per epoch
HOLD_STEP = STEPS + 2  # in epoch 1, after epoch 0's checkpoint


def fit_args(*extra: str) -> list[str]:
    return [
        "fit",
        "-c",
        DDP_YAML,
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        f"--trainer.logger.init_args.save_dir={LOGS}",
        "--trainer.max_epochs=2",
        f"--trainer.limit_train_batches={STEPS}",
        "--trainer.limit_val_batches=2",
        *extra,
    ]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    aside = s3_path()
    with pytest.MonkeyPatch.context() as patch:  # this worker imports s3fs too, until the module's tests end
        patch.syspath_prepend(aside)
        import s3fs

        port = free_port()
        env = {"PYTHONPATH": os.pathsep.join([str(REPO), aside])}
        log = tmp_path_factory.mktemp("s3") / "moto.log"
        server = serve([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port, log, env=env)
        try:
            env |= {
                "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test",
                "AWS_DEFAULT_REGION": "us-east-1",
            }
            fs = s3fs.S3FileSystem(
                endpoint_url=env["AWS_ENDPOINT_URL"], key="test", secret="test", skip_instance_cache=True
            )
            fs.mkdir(BUCKET)
            yield SimpleNamespace(env=env, fs=fs)
        finally:
            server.kill()
            server.wait()


def files(s3, prefix: str) -> list[str]:
    """The objects under ``prefix``, relative to it."""
    s3.fs.invalidate_cache()
    base = prefix.removeprefix("s3://")
    return sorted(path.removeprefix(f"{base}/") for path in s3.fs.find(base))


def load(s3, url: str) -> dict:
    s3.fs.invalidate_cache()  # the object may have been written again since this process last read it
    with s3.fs.open(url, "rb") as file:
        return torch.load(file, weights_only=True)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("object_storage")


@pytest.fixture(scope="module")
def killed(s3, workdir):
    """The run, killed (SIGKILL to every process) while its ranks hold in epoch 1."""
    hold = workdir / "kill.hold"
    hold.touch()
    args = fit_args("--trainer.callbacks+=tests.helpers.probe.HoldAtStep", f"--trainer.callbacks.step={HOLD_STEP}")
    process = subprocess.Popen(
        [sys.executable, str(REPO / "cli.py"), *args, f"--trainer.callbacks.hold_file={hold}"],
        cwd=workdir,
        env={**os.environ, **s3.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    wait_for_hold(hold, 2, process)
    # Epoch 0's checkpoint is written by a thread, which may still be uploading it while the ranks hold.
    deadline = time.monotonic() + 300
    while not files(s3, f"{RUN}/checkpoints").count("last.ckpt"):
        assert time.monotonic() < deadline, "epoch 0's last.ckpt never reached the bucket"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    hold.unlink()
    return process.returncode, load(s3, f"{RUN}/checkpoints/last.ckpt")


@pytest.fixture(scope="module")
def resumed(s3, workdir, killed):
    """The same command again, with tests.helpers.probe.RankProbe."""
    args = [str(REPO / "cli.py"), *fit_args(), *probe_args(workdir / "probe")]
    result = run_script(args, cwd=workdir, env=s3.env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output, probe_records(workdir / "probe", world_size=2)


@pytest.mark.distributed
def test_a_killed_run_resumes_from_the_object_store(s3, killed, resumed):
    returncode, at_kill = killed
    assert returncode == -signal.SIGKILL
    assert (at_kill["epoch"], at_kill["global_step"]) == (0, STEPS)
    output, records = resumed
    assert output.count(f"Resuming from {RUN}/checkpoints/last.ckpt (epoch 0, step {STEPS}).") == 1, output
    final = load(s3, f"{RUN}/checkpoints/last.ckpt")
    assert final["global_step"] == 2 * STEPS
    assert [(r["global_rank"], r["world_size"]) for r in records] == [(0, 2), (1, 2)]
    for record in records:
        for name, value in final["state_dict"].items():
            assert torch.equal(record["params"][name], value), name


@pytest.mark.distributed
def test_the_run_writes_its_files_to_the_bucket_only(s3, workdir, resumed):
    written = files(s3, RUN)
    assert {"config.yaml", "hparams.yaml", "checkpoints/last.ckpt"} <= set(written), written
    assert any(name.startswith("events.out.tfevents.") for name in written), written
    best = [name for name in written if name.startswith("checkpoints/epoch")]
    assert len(best) == 1, f"save_top_k=1 keeps one best checkpoint: {written}"
    assert not [name for name in written if name.endswith(".partial")]
    assert not (workdir / "logs").exists(), "the run wrote into a local logs/"


@pytest.mark.distributed
def test_validate_test_and_predict_use_the_checkpoint_in_the_bucket(s3, resumed, run_cli, monkeypatch, caplog, capsys):
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    common = [
        "-c",
        DDP_YAML,
        *SINGLE_PROCESS,
        f"--trainer.logger.init_args.save_dir={LOGS}",
        "--trainer.limit_val_batches=2",
    ]
    explicit = f"--ckpt_path={RUN}/checkpoints/last.ckpt"
    with caplog.at_level(logging.INFO):
        run_cli("validate", *common)  # ckpt_path: last of configs/ddp.yaml, found in the bucket
        run_cli("test", *common, "--trainer.limit_test_batches=2", explicit)
        run_cli("predict", *common, explicit)
    weights = f"with the weights of {RUN}/checkpoints/last.ckpt (epoch 1, step {2 * STEPS})."
    for doing in ("Validating", "Testing", "Predicting"):
        assert caplog.text.count(f"{doing} {weights}") == 1, caplog.text
    assert f"Wrote 1024 predictions to {RUN}/predictions.pt" in capsys.readouterr().out
    assert load(s3, f"{RUN}/predictions.pt").shape == (1024, 8)
    assert {"validate-config.yaml", "test-config.yaml", "predict-config.yaml"} <= set(files(s3, RUN))
    assert not (Path.cwd() / "logs").exists()


@pytest.mark.distributed
def test_a_run_resumed_from_its_best_checkpoint_keeps_that_checkpoint(s3, resumed, run_cli, monkeypatch):
    # Lightning 2.6.6 removes the checkpoint a run resumed from, once a better one is saved, when it lies in an
    # object store (#21813); on a local disk it keeps it.
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    (best,) = [name for name in files(s3, RUN) if name.startswith("checkpoints/epoch")]
    run_cli(*fit_args(*SINGLE_PROCESS, "--trainer.max_epochs=3", f"--ckpt_path={RUN}/{best}"))
    written = [name for name in files(s3, RUN) if name.startswith("checkpoints/epoch")]
    assert best in written, "the checkpoint the run resumed from was removed"
    assert len(written) == 2, f"no better checkpoint was saved, so none was up for removal: {written}"
    assert load(s3, f"{RUN}/checkpoints/last.ckpt")["global_step"] == 3 * STEPS


@pytest.mark.distributed
def test_on_a_plateau_last_ckpt_in_the_bucket_is_the_latest_state(s3, run_cli, monkeypatch):
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    plateau = ["--model=tests.test_last_checkpoint.Plateau", "--trainer.max_epochs=2"]  # val/loss never improves
    run_cli(*fit_args(*SINGLE_PROCESS, *plateau))
    checkpoints = f"{LOGS}/plateau/default/checkpoints"
    assert files(s3, checkpoints) == ["epoch000-val_loss1.0000.ckpt", "last.ckpt"]
    last = load(s3, f"{checkpoints}/last.ckpt")
    assert (last["epoch"], last["global_step"]) == (1, 2 * STEPS)


@pytest.mark.distributed
def test_a_checkpoint_the_bucket_does_not_hold_is_named_before_anything_starts(s3, run_cli, monkeypatch, capsys):
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        run_cli("validate", "-c", DDP_YAML, *SINGLE_PROCESS, f"--ckpt_path={RUN}/checkpoints/missing.ckpt")
    assert exit_info.value.code == 2
    assert f"error: --ckpt_path {RUN}/checkpoints/missing.ckpt: no such checkpoint file or directory." in (
        capsys.readouterr().err
    )


def test_a_file_another_thread_writes_into_the_store_during_a_checkpoint_upload_is_left_to_it(s3, monkeypatch):
    """As TensorBoard's event writer writes its events file while a checkpoint uploads: the file is in the store once
    its writer closes it. Lightning's own save holds the store's transaction, which fsspec shares with every thread,
    during the upload: the file would join it, and only the save's commit would finish it, under its writer."""
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    checkpoint, events, written = f"s3://{BUCKET}/other-thread/last.ckpt", f"{BUCKET}/other-thread/events.out", []
    fs = get_filesystem(checkpoint)  # the instance the save gets: fsspec keeps one per store and settings
    pipe = fs.pipe

    def upload_while_another_thread_writes(path, value, **kwargs):
        def write_events() -> None:
            with fs.open(events, "wb") as file:
                file.write(b"an event")
            fs.invalidate_cache()
            written.append(fs.exists(events) and fs.cat(events))

        writer = threading.Thread(target=write_events)
        writer.start()
        writer.join()
        return pipe(path, value, **kwargs)

    monkeypatch.setattr(fs, "pipe", upload_while_another_thread_writes)
    AtomicCheckpointIO().save_checkpoint({"global_step": 7}, checkpoint)
    assert written == [b"an event"]
    assert load(s3, checkpoint) == {"global_step": 7}


def test_an_object_store_without_its_client_names_the_requirements_file(monkeypatch):
    def no_client(protocol: str):
        raise ImportError(f"Install s3fs to access {protocol}")

    monkeypatch.setattr("training.run.storage.fsspec.get_filesystem_class", no_client)
    settings = {"trainer": {"logger": {"init_args": {"save_dir": "s3://runs/logs"}}}}
    assert storage_problem(settings) == (
        "the logger's save_dir is s3://runs/logs: reading and writing s3:// URLs needs s3fs, which is not installed. "
        "Install it (pip install -r requirements-s3.txt), or give a local path."
    )
    assert storage_problem({"trainer": {"logger": {"init_args": {"save_dir": "logs"}}}}) is None
