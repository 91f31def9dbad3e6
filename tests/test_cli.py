"""The LightningCLI entry point, driven in-process: subcommands, plug-in modules, saved configs, bad input."""

import gc
import os
import socket
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator
from lightning.pytorch.demos.boring_classes import BoringModel
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import cli
from models import ToyModel
from tests.helpers import DDP_YAML, REPO, SINGLE_PROCESS, run_script, stopped_in_the_run
from training.config.checks import refused_setting
from training.config.network import gloo_interface_problem
from training.config.trainer_settings import devices_problem
from training.private_api import subcommand_parser


def test_fit_fast_dev_run_trains_the_toy_model(run_cli):
    torch.set_float32_matmul_precision("highest")
    result = run_cli("fit", "-c", DDP_YAML, *SINGLE_PROCESS, "--trainer.fast_dev_run=2", "--matmul_precision=medium")
    assert isinstance(result.model, ToyModel)
    assert result.trainer.global_step == 2
    assert torch.isfinite(result.trainer.callback_metrics["val/loss"])
    assert torch.get_float32_matmul_precision() == "medium"  # set for the process, before the Trainer
    with pytest.raises(KeyError):  # the parsers of the subcommands not run are never built (a third of a parse)
        subcommand_parser(result, "validate")


def test_help_and_a_mistyped_subcommand_name_all_four_subcommands(run_cli, capsys):
    with pytest.raises(SystemExit) as stopped:
        run_cli("--help")
    assert stopped.value.code == 0
    assert "{fit,validate,test,predict}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stopped:
        run_cli("fitt", "-c", DDP_YAML)
    assert stopped.value.code == 2
    assert "invalid choice: 'fitt' (choose from 'fit', 'validate', 'test', 'predict')" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        run_cli("test", "--help")
    assert stopped.value.code == 0
    assert "--ckpt_path" in capsys.readouterr().out


def test_the_imports_leave_the_garbage_collector_on_and_what_they_made_frozen(tmp_path):
    # cli.py turns the collector off for its imports: left off, a run would never free a reference cycle.
    state = "import gc, cli; print(gc.isenabled(), gc.get_freeze_count())"
    result = run_script([sys.executable, "-c", state], tmp_path)
    assert result.returncode == 0, result.stderr
    enabled, frozen = result.stdout.split()
    assert enabled == "True"
    assert int(frozen) > 100_000, "the objects torch and Lightning made are not frozen"


def test_what_the_imports_froze_goes_back_to_the_collector_at_exit_only_beside_a_nanobind_extension():
    nanobind_function = type("nb_func", (), {})()  # what nanobind's functions are, whatever their module
    extension = types.ModuleType("bound")
    extension.__file__, extension.f = "/site-packages/bound.cpython-313-x86_64-linux-gnu.so", nanobind_function
    plain = types.ModuleType("plain")
    plain.__file__, plain.f = "/site-packages/plain.py", nanobind_function  # not an extension: no nanobind there
    gc.freeze()
    try:
        cli.unfreeze_for_nanobind({"plain": plain, "gc": gc})
        assert gc.get_freeze_count() > 0, "unfrozen without a nanobind extension: a second of CPU at every exit"
        cli.unfreeze_for_nanobind({"plain": plain, "bound": extension})
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_data_shapes_are_linked_into_the_model(run_cli):
    result = run_cli(
        "fit",
        "-c",
        DDP_YAML,
        *SINGLE_PROCESS,
        "--trainer.fast_dev_run=1",
        "--data.init_args.num_features=5",
        "--data.init_args.num_targets=3",
    )
    assert result.model.hparams.in_features == 5
    assert result.model.hparams.out_features == 3


def test_optimizer_is_set_from_yaml(run_cli, tmp_path):
    override = tmp_path / "sgd.yaml"
    override.write_text(
        "model:\n  init_args:\n    optimizer:\n      class_path: torch.optim.SGD\n"
        "      init_args:\n        lr: 0.05\n        momentum: 0.5\n"
    )
    result = run_cli("fit", "-c", DDP_YAML, "-c", str(override), *SINGLE_PROCESS, "--trainer.fast_dev_run=1")
    optimizer = result.trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.defaults["lr"] == 0.05 and optimizer.defaults["momentum"] == 0.5


def test_any_module_plugs_in_by_class_path(run_cli):
    result = run_cli(
        "fit",
        "--model",
        "lightning.pytorch.demos.boring_classes.BoringModel",
        "--data",
        "lightning.pytorch.demos.boring_classes.BoringDataModule",
        "--trainer.fast_dev_run=1",
        "--trainer.accelerator=cpu",
    )
    assert type(result.model) is BoringModel
    assert result.trainer.global_step == 1


def scalars(directory) -> dict[str, list[int]]:
    """The steps of each scalar but the epoch and the step times (tests/test_step_time.py) in the TensorBoard files of
    ``directory`` (not of its subdirectories)."""
    events = EventAccumulator(str(directory))
    events.Reload()
    tags = [tag for tag in events.Tags()["scalars"] if tag != "epoch" and not tag.startswith("timing/")]
    return {tag: [event.step for event in events.Scalars(tag)] for tag in tags}


def test_subcommands_run_from_a_saved_checkpoint_and_log_apart_from_the_training_curves(run_cli, tmp_path):
    args = ["-c", DDP_YAML, *SINGLE_PROCESS, "--trainer.limit_val_batches=2"]
    fit = run_cli(
        "fit", *args, "--trainer.max_epochs=1", "--trainer.limit_train_batches=4", "--trainer.log_every_n_steps=1"
    )
    run = tmp_path / "logs" / "toy" / "default"
    last = run / "checkpoints" / "last.ckpt"
    assert last.is_file()
    trained, curves, hparams = fit.model.state_dict(), scalars(run), (run / "hparams.yaml").read_bytes()

    # validate is given the checkpoint; test and predict find the run's last one themselves (ckpt_path: last).
    for subcommand, given in (("validate", ["--ckpt_path", str(last)]), ("test", []), ("predict", [])):
        result = run_cli(subcommand, *args, *given)
        for name, value in result.model.state_dict().items():
            assert torch.equal(value, trained[name]), (subcommand, name)
        assert (run / f"{subcommand}-config.yaml").is_file(), subcommand
        if subcommand == "predict":
            predictions = torch.cat(result.trainer.predict_loop.predictions)
            assert predictions.shape == (1024, 8)
            assert torch.equal(torch.load(run / "predictions.pt"), predictions)
        else:
            stage = "val" if subcommand == "validate" else "test"
            assert torch.isfinite(result.trainer.callback_metrics[f"{stage}/loss"]), subcommand
    assert scalars(run) == curves == {"train/loss": [0, 1, 2, 3], "val/loss": [3]}
    assert scalars(run / "validate") == {"val/loss": [0]} and scalars(run / "test") == {"test/loss": [0]}
    assert not (run / "predict").exists(), "predict logs no metrics, and leaves no empty TensorBoard run"
    assert (run / "hparams.yaml").read_bytes() == hparams

    (tmp_path / "mine").touch()  # the permissions a file of the user's gets under this umask
    for path in run.rglob("*"):
        assert path.is_dir() or path.stat().st_mode == (tmp_path / "mine").stat().st_mode, path


def test_predict_without_a_checkpoint_is_refused_unless_untrained_weights_are_asked_for(
    run_cli, capsys, caplog, tmp_path
):
    with pytest.raises(SystemExit) as exit_:
        run_cli("predict", "-c", DDP_YAML, *SINGLE_PROCESS)
    assert exit_.value.code == 2
    run = tmp_path / "logs" / "toy" / "default"
    err = capsys.readouterr().err
    assert (
        f"error: nothing to predict with: {run / 'checkpoints'} holds no last.ckpt and --ckpt_path names no other "
        "checkpoint, so the model's weights are untrained and its predictions random." in err
    )
    assert "give --ckpt_path untrained to predict with untrained weights on purpose. Nothing was written." in err
    assert "Traceback" not in err and not (tmp_path / "logs").exists()

    run_cli("predict", "-c", DDP_YAML, *SINGLE_PROCESS, "--ckpt_path", "untrained")
    told = f"Predicting with untrained weights: no checkpoint was loaded, {run / 'checkpoints'} holds no last.ckpt."
    assert told in caplog.text
    assert torch.load(run / "predictions.pt").shape == (1024, 8)


class StopAfterParsing(cli.CLI):
    def before_instantiate_classes(self) -> None:
        raise SystemExit(0)


def test_more_cpu_processes_than_cores_are_warned_of_before_anything_starts(capsys, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for devices, warned in (3, True), (2, False):
        with pytest.raises(SystemExit):
            cli.main(
                ["fit", "-c", DDP_YAML, "--trainer.accelerator=cpu", f"--trainer.devices={devices}"], StopAfterParsing
            )
        err = capsys.readouterr().err
        told = (
            "warning: trainer.devices=3 starts 3 training processes on this node, which gives them 2 CPU cores: they "
            "take turns on the cores, so each step is slower than with one process per core. Set trainer.devices to "
            "at most 2 for a core each."
        )
        assert (told in err) == warned, err
    monkeypatch.setenv("LOCAL_RANK", "1")  # a process Lightning started: its node has heard it already
    with pytest.raises(SystemExit):
        cli.main(["fit", "-c", DDP_YAML, "--trainer.accelerator=cpu", "--trainer.devices=3"], StopAfterParsing)
    assert "warning" not in capsys.readouterr().err


def test_the_progress_bar_shows_the_run_id_whole(run_cli, monkeypatch):
    monkeypatch.setenv("RUN_ID", "lr-3e-4")
    result = run_cli("fit", "-c", DDP_YAML, *SINGLE_PROCESS, "--trainer.max_steps=1", "--trainer.limit_val_batches=0")
    metrics = result.trainer.progress_bar_callback.get_metrics(result.trainer, result.model)
    assert metrics["run"] == "lr-3e-4" and "v_num" not in metrics


def test_another_model_logs_under_its_own_name(run_cli, tmp_path):
    boring = "lightning.pytorch.demos.boring_classes"
    run_cli(
        "test",
        "-c",
        DDP_YAML,
        *SINGLE_PROCESS,
        "--model",
        f"{boring}.BoringModel",
        "--data",
        f"{boring}.BoringDataModule",
    )
    assert [path.name for path in (tmp_path / "logs").iterdir()] == ["boring"]
    assert (tmp_path / "logs" / "boring" / "default" / "test-config.yaml").is_file()


def test_every_config_parses_through_the_cli(run_cli, capsys):
    configs = sorted((REPO / "configs").glob("*.yaml"))
    assert configs, "no configs found"
    for config in configs:
        extra = [] if config.name == "ddp.yaml" else ["-c", str(config)]
        if config.name.startswith("seq2seq_"):  # the example's settings for a purpose, after configs/seq2seq.yaml
            extra = ["-c", str(REPO / "configs" / "seq2seq.yaml"), *extra]
        with pytest.raises(SystemExit) as exit_info:
            run_cli("fit", "-c", DDP_YAML, *extra, "--print_config")
        assert exit_info.value.code == 0, config.name
        printed = yaml.safe_load(capsys.readouterr().out)
        for section in yaml.safe_load(config.read_text()):
            assert section in printed, f"{config.name}: {section} missing from the parsed config"


def expect_usage_error(run_cli, capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(*args)
    assert exit_info.value.code != 0
    return capsys.readouterr().err


def test_unknown_yaml_key_is_named(run_cli, capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_epochz: 3\n")
    err = expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "-c", str(bad))
    assert "trainer.max_epochz" in err


def test_a_trainer_key_at_the_top_of_a_config_file_says_where_it_goes(run_cli, capsys, tmp_path):
    misplaced = tmp_path / "epochs.yaml"
    misplaced.write_text("max_epochs: 3\n")
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "-c", str(misplaced)))
    assert err == (
        "error: Subcommand 'fit' does not accept option 'max_epochs'. max_epochs is a Trainer argument: in a config "
        "file it goes under trainer: (indented below a line trainer:), on the command line it is --trainer.max_epochs."
    )


def test_unknown_model_argument_is_named(run_cli, capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  init_args:\n    hidden_featurez: 3\n")
    err = expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "-c", str(bad))
    assert "hidden_featurez" in err and "is not accepted" in err


def one_paragraph(err: str) -> str:
    """The error at the end of ``err``, checked to be one paragraph under at most the usage and tip lines."""
    assert "Traceback" not in err and "NestedArg" not in err and "Subtypes" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) <= 3 and lines[-1].startswith("error: "), err
    return lines[-1]


@pytest.mark.parametrize(
    "argument, accepted",
    [
        ("--model.init_args.hidden=3", "models.ToyModel accepts: in_features, hidden_features, out_features"),
        ("--data.init_args.batch=3", "data.RandomDataModule accepts: num_features, num_targets"),
        ("--model.init_args.optimizer.init_args.lrr=1", "torch.optim.AdamW accepts: params, lr, betas"),
    ],
)
def test_an_unknown_argument_names_the_class_and_what_it_accepts(run_cli, capsys, argument, accepted):
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, argument))
    wrong = argument.split("=")[0].rsplit(".", 1)[-1]
    assert f"Option '{wrong}' is not accepted. {accepted}" in err
    closest = {"hidden": "hidden_features", "batch": "batch_size", "lrr": "lr"}[wrong]
    assert err.endswith(f"(closest to '{wrong}': {closest}).")


@pytest.mark.parametrize(
    "class_path, reason", [("models.NoSuch", "module 'models' has no attribute 'NoSuch'"), ("nopkg.M", "No module")]
)
def test_an_unknown_class_names_the_module_and_the_class(run_cli, capsys, class_path, reason):
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "--model", class_path))
    assert f"""error: Parser key "model": Problem with given class_path '{class_path}': {reason}""" in err


@pytest.mark.parametrize("in_yaml", [True, False])
def test_a_misspelt_class_gets_the_closest_class_of_its_module(run_cli, capsys, tmp_path, in_yaml):
    class_path = "lightning.pytorch.callbacks.EarlyStoping"
    (tmp_path / "es.yaml").write_text(f"trainer:\n  callbacks+:\n    - class_path: {class_path}\n")
    given = ["-c", str(tmp_path / "es.yaml")] if in_yaml else [f"--trainer.callbacks+={class_path}"]
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, *given))
    assert err == (
        f"""error: Parser key "trainer.callbacks": Problem with given class_path '{class_path}': module """
        "'lightning.pytorch.callbacks' has no attribute 'EarlyStoping'. Closest to 'EarlyStoping' in "
        "lightning.pytorch.callbacks: EarlyStopping."
    )


@pytest.mark.parametrize(
    "config, told",
    [
        ("configs/bf16.yaml", "required: fit.model. Start from the main config and add feature files after it"),
        ("configs/seq2seq.yaml", "goes after the file that names the class, as in -c configs/ddp.yaml -c configs"),
    ],
)
def test_a_feature_config_given_alone_says_to_add_it_to_the_main_one(run_cli, capsys, config, told):
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", str(REPO / config)))
    assert told in err


def test_an_optimizer_value_torch_rejects_stops_before_anything_starts(run_cli, capsys, tmp_path):
    err = expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "--model.init_args.optimizer.init_args.lr=-1")
    assert one_paragraph(err) == (
        "error: model.optimizer (torch.optim.AdamW): Invalid learning rate: -1.0. Fix the value in the config or "
        "on the command line."
    )
    assert not (tmp_path / "logs").exists()


def test_a_setting_lightning_rejects_in_the_run_is_one_paragraph(run_cli, capsys, tmp_path):
    monitor = tmp_path / "monitor.yaml"
    monitor.write_text(
        # Without MonitorCheck, which would name it earlier, as the template's own paragraph.
        "turn_off: [MonitorCheck]\n"
        "trainer:\n  callbacks+:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        "      init_args:\n        monitor: accuracy\n"
    )
    args = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"]
    assert stopped_in_the_run(run_cli, capsys, "-c", str(monitor), *args) == (
        "error: `ModelCheckpoint(monitor='accuracy')` could not find the monitored key in the returned metrics: "
        "['train/loss', 'val/loss', 'epoch', 'step']. HINT: Did you call `log('accuracy', value)` in the "
        "`LightningModule`?"
    )


def test_a_setting_lightning_checks_only_against_the_data_is_one_paragraph(run_cli, capsys):
    # Lightning raises a ValueError once the data is set up: the launching process cannot find it earlier.
    assert stopped_in_the_run(run_cli, capsys, "--trainer.max_epochs=1", "--trainer.val_check_interval=1000") == (
        "error: `val_check_interval` (1000) must be less than or equal to the number of the training batches (128). "
        "If you want to disable validation set `limit_val_batches` to 0.0 instead. If you want to validate based on "
        "the total training batches, set `check_val_every_n_epoch=None`. Fix the trainer settings in the config files "
        "or on the command line."
    )


def test_only_a_value_error_of_lightnings_own_code_naming_a_trainer_argument_is_a_refused_setting():
    def raised(message: str, module: str) -> ValueError:
        try:
            exec(f"raise ValueError({message!r})", {"__name__": module})
        except ValueError as error:
            return error
        raise AssertionError("nothing raised")

    assert refused_setting(raised("`max_epochs` is -5", "lightning.pytorch.loops.fit_loop")) == (
        "`max_epochs` is -5 Fix the trainer settings in the config files or on the command line."
    )
    assert refused_setting(raised("`max_epochs` is -5", "my_package.model")) is None, "a bug in the user's code"
    assert refused_setting(raised("`no_such_argument` is -5", "lightning.pytorch.loops.fit_loop")) is None
    assert refused_setting(RuntimeError("`max_epochs`")) is None


@pytest.mark.parametrize(
    "setting, told",
    [
        (
            "accumulate_grad_batches=0",
            "Lightning divides by it and would stop at the first batch with a ZeroDivisionError",
        ),
        ("check_val_every_n_epoch=0", "Lightning divides by it and would stop at the end of the first epoch with a"),
        (
            "gradient_clip_val=-1",
            "Lightning clips nothing at a value below 0, without a word. trainer.gradient_clip_val "
            "takes the gradient norm (or value) to clip at, such as 1.0, or null (or 0) for no clipping.",
        ),
        (
            "strategy.init_args.peer_timeout=0:00:00",
            'a wait of no time would stop the job at its first chance. Give a duration as "h:mm:ss", such as the '
            '"0:01:00" of configs/ddp.yaml.',
        ),
    ],
)
def test_a_trainer_value_lightning_takes_unchecked_stops_before_anything_starts(
    run_cli, capsys, tmp_path, setting, told
):
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, f"--trainer.{setting}"))
    assert err.startswith(f"error: trainer.{setting}: {told}")  # the value as given, whatever type the Trainer has
    assert not (tmp_path / "logs").exists()


def test_a_gpu_accelerator_without_a_gpu_says_what_torch_sees_and_what_to_do(run_cli, capsys, monkeypatch):
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: False))
    monkeypatch.setattr(MPSAccelerator, "is_available", staticmethod(lambda: False))
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "--trainer.accelerator=gpu"))
    assert err.startswith(
        f"error: trainer.accelerator=gpu, but torch sees no GPU on this machine (torch {torch.__version__}"
    )
    assert err.endswith(
        "Train on CPU with trainer.accelerator=cpu, or auto (every visible GPU, else the CPU); for GPUs, "
        "install a CUDA build of torch and the NVIDIA driver, and check CUDA_VISIBLE_DEVICES."
    )


def test_a_required_argument_of_a_class_gets_no_hint_about_the_main_config(run_cli, capsys):
    callback = "--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping"
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, callback))
    assert err == (
        """error: Parser key "trainer.callbacks": Problem with given class_path 'lightning.pytorch.callbacks."""
        "EarlyStopping': the following arguments are required: monitor"
    )


def test_wrong_type_is_named(run_cli, capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_epochs: three\n")
    err = expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "-c", str(bad))
    assert 'Parser key "trainer.max_epochs"' in err and "three" in err


def test_a_rejected_value_from_the_environment_names_the_variable(run_cli, capsys, monkeypatch):
    monkeypatch.setenv("NUM_NODES", "two")  # configs/ddp.yaml: num_nodes: ${oc.decode:${oc.env:NUM_NODES,1}}
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML))
    assert err == (
        """error: Parser key "trainer.num_nodes": Expected a <class 'int'>. Got value: two. ddp.yaml takes """
        "trainer.num_nodes from the environment variable NUM_NODES: set NUM_NODES to a value it accepts, or unset it."
    )
    monkeypatch.setenv("NUM_NODES", "2")  # now the command line gives the value the parser rejects
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "--trainer.num_nodes=three"))
    assert err == """error: Parser key "trainer.num_nodes": Expected a <class 'int'>. Got value: three"""


def test_a_rejected_value_of_a_class_argument_is_named(run_cli, capsys):
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "--data.init_args.batch_size=x"))
    assert err.endswith("""Parser key "batch_size": Expected a <class 'int'>. Got value: x""")


def test_missing_config_file_is_named(run_cli, capsys):
    err = expect_usage_error(run_cli, capsys, "fit", "-c", "configs/missing.yaml")
    assert "configs/missing.yaml" in err and "does not exist" in err


def test_a_misspelt_config_file_gets_the_closest_existing_file(run_cli, capsys, tmp_path):
    (tmp_path / "configs").mkdir()
    for name in ("ddp.yaml", "bf16.yaml", "seq2seq.yaml"):
        (tmp_path / "configs" / name).write_text("{}\n")
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", "configs/ddp.yml"))
    assert err.endswith(f"File does not exist: '{tmp_path}/configs/ddp.yml'. Did you mean configs/ddp.yaml?"), err
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", "configs/nothing-like-it.yaml"))
    assert "Did you mean" not in err


def test_malformed_yaml_names_the_file_and_line(run_cli, capsys, tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("trainer:\n  max_epochs: [1\n")
    err = expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "-c", str(bad))
    assert "config file broken.yaml is not valid YAML" in err and "line 3" in err


def test_unresolvable_interpolation_names_the_file(run_cli, capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("TEMPLATE_TEST_UNSET", raising=False)
    bad = tmp_path / "env.yaml"
    bad.write_text("trainer:\n  max_epochs: ${oc.env:TEMPLATE_TEST_UNSET}\n")
    err = expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "-c", str(bad))
    assert "config file env.yaml" in err and "TEMPLATE_TEST_UNSET" in err


def test_missing_checkpoint_is_named(run_cli, capsys):
    err = expect_usage_error(run_cli, capsys, "test", "-c", DDP_YAML, "--ckpt_path", "nowhere/last.ckpt")
    assert "--ckpt_path nowhere/last.ckpt: no such checkpoint file" in err


def test_a_checkpoint_directory_that_is_not_sharded_is_named(run_cli, capsys, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    err = expect_usage_error(run_cli, capsys, "test", "-c", DDP_YAML, "--ckpt_path", "checkpoints")
    assert one_paragraph(err) == (
        "error: --ckpt_path checkpoints is a directory, but not a sharded checkpoint (it has no .metadata file). "
        "Give the path of a .ckpt file in it, such as checkpoints/last.ckpt."
    )


def test_a_file_where_the_run_directory_should_be_stops_before_anything_starts(run_cli, capsys, tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "toy").write_text("not a directory\n")
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML))
    assert err == (
        f"error: the run writes into logs/toy/default (from trainer.logger.init_args.save_dir=logs), but "
        f"{tmp_path}/logs/toy is a file, not a directory. Move that file away, or give that setting another "
        "directory. Nothing was started."
    )
    assert (tmp_path / "logs" / "toy").read_text() == "not a directory\n"


def test_a_run_directory_this_user_may_not_write_in_stops_before_anything_starts(
    run_cli, capsys, tmp_path, monkeypatch
):
    # Root writes in a directory of mode 555: the directory answers as a read-only mount (or another user's) would.
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != readonly and access(path, mode, **kw))
    err = one_paragraph(
        expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "--trainer.logger.init_args.save_dir=readonly")
    )
    assert err == (
        f"error: the run writes into readonly/toy/default (from trainer.logger.init_args.save_dir=readonly), but "
        f"this user (uid {os.getuid()}) may not write in {readonly}. Make {readonly} writable for this user, or give "
        "that setting another directory. Nothing was started."
    )
    assert not any(readonly.iterdir())


def test_a_gloo_interface_this_machine_lacks_stops_before_anything_starts(run_cli, capsys, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,nosuch0")
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "--trainer.accelerator=cpu"))
    here = ", ".join(name for _, name in socket.if_nameindex())
    assert err == (
        f"error: GLOO_SOCKET_IFNAME=lo,nosuch0 is set in the environment, but this machine ({socket.gethostname()}) "
        f"has no network interface named nosuch0; it has {here}. gloo carries the job's traffic over that interface "
        "and cannot start without it: unset GLOO_SOCKET_IFNAME, or name the interface of the network the nodes share "
        "(ip -br addr lists them; scripts/run_ddp_train.sh sets it from SOCKET_IFNAME or the route to MASTER_ADDR). "
        "Nothing was started."
    )
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert gloo_interface_problem({"trainer": {"accelerator": "cpu"}}) is None
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")  # NCCL, which reads NCCL_SOCKET_IFNAME, carries a GPU job
    assert gloo_interface_problem({"trainer": {"accelerator": "cuda"}}) is None


def test_impossible_batch_size_names_the_flag(run_cli, capsys):
    err = expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "--data.init_args.batch_size=0")
    assert "error: data.batch_size must be a positive integer, got 0" in err
    assert "Union" not in err  # the constructor's message alone, not jsonargparse's report on each type it tried


def test_main_config_uses_every_gpu_when_there_is_one(run_cli, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        run_cli("fit", "-c", DDP_YAML, "--print_config")
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert trainer["devices"] == "auto" and trainer["accelerator"] == "auto"


def test_main_config_starts_two_cpu_processes_without_a_gpu(run_cli, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("NUM_NODES", "3")
    with pytest.raises(SystemExit):
        run_cli("fit", "-c", DDP_YAML, "--print_config")
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert trainer["devices"] == 2 and trainer["num_nodes"] == 3
    assert trainer["strategy"]["init_args"]["timeout"] == "0:30:00"


def test_settings_the_trainer_rejects_together_are_named(run_cli, capsys):
    # configs/ddp.yaml declares the progress bar; turning it off is refresh_rate: 0 on that entry.
    with pytest.raises(SystemExit) as exit_:
        run_cli("fit", "-c", DDP_YAML, *SINGLE_PROCESS, "--trainer.enable_progress_bar=false")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "`enable_progress_bar=False` but found `ProgressBar` in callbacks list. Fix the trainer settings" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("devices", ["abc", "-5", "-1", "0,1"])
def test_a_devices_value_lightning_cannot_use_on_cpu_says_what_it_takes(run_cli, capsys, monkeypatch, devices):
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: False))
    monkeypatch.setattr(MPSAccelerator, "is_available", staticmethod(lambda: False))
    with pytest.raises(SystemExit) as exit_:
        run_cli("fit", "-c", DDP_YAML, f"--trainer.devices={devices}")
    assert exit_.value.code == 2
    assert one_paragraph(capsys.readouterr().err) == (
        f"error: trainer.devices={devices} is not a number of processes: on CPU (this machine has no GPU) "
        "trainer.devices takes a positive number of processes per node, such as 2; -1 and GPU ids need GPUs."
    )


def test_devices_values_are_checked_by_the_rules_of_the_accelerator_lightning_picks(monkeypatch):
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    for devices in ("auto", -1, "-1", 2, "2", [0, 1], "0,1", "1,", "1, 2"):
        assert devices_problem({"trainer": {"devices": devices}}) is None, devices
    for devices in ("abc", -5, "-5", 0, "0", [], [0, 0], "0,x", "2.5", [-1]):
        assert "names no devices: trainer.devices takes a number" in devices_problem({"trainer": {"devices": devices}})
    for devices in (-1, [1], "0,1"):
        cpu = {"trainer": {"devices": devices, "accelerator": "cpu"}}
        assert "on CPU (trainer.accelerator=cpu) trainer.devices takes a positive number" in devices_problem(cpu)


@pytest.mark.parametrize("run_id", ["../../elsewhere", "..", "a/b", "x" * 101, "with space"])
def test_a_run_id_must_be_a_name(run_cli, capsys, monkeypatch, tmp_path, run_id):
    monkeypatch.setenv("RUN_ID", run_id)
    with pytest.raises(SystemExit) as exit_:
        run_cli("fit", "-c", DDP_YAML, *SINGLE_PROCESS, "--trainer.fast_dev_run=1")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"RUN_ID={run_id!r} is not a run name: use letters, digits, '-', '_' and '.'" in err
    assert "Traceback" not in err and not (tmp_path / "../../elsewhere").resolve().exists()


def test_a_run_id_names_the_run_directory(run_cli, monkeypatch, tmp_path):
    monkeypatch.setenv("RUN_ID", "lr-3e-4.b_2")
    run_cli("fit", "-c", DDP_YAML, *SINGLE_PROCESS, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2")
    run = tmp_path / "logs" / "toy" / "lr-3e-4.b_2"
    assert (run / "checkpoints" / "last.ckpt").is_file()
    events = EventAccumulator(str(run))
    events.Reload()
    assert "val/loss" in events.Tags()["scalars"]
    assert "hp_metric" not in events.Tags()["scalars"], "TensorBoard shows a placeholder hp_metric"
