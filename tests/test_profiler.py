"""configs/profile.yaml in a real 2-process run: every rank writes a trace of the configured steps. Without it the
template's NoProfiler profiles nothing at no cost, and a profiler given in its place still sees every hook."""

import json

import pytest
import yaml

from tests.helpers import DDP_YAML, REPO, SINGLE_PROCESS, run_script
from training import NoProfiler, ScheduledProfiler

PROFILE_YAML = REPO / "configs" / "profile.yaml"


@pytest.mark.distributed
def test_each_rank_writes_a_trace_of_the_active_steps(tmp_path):
    schedule = yaml.safe_load(PROFILE_YAML.read_text())["trainer"]["profiler"]["init_args"]
    batches = schedule["skip_first"] + schedule["wait"] + schedule["warmup"] + schedule["active"]
    result = run_script(
        [
            str(REPO / "cli.py"),
            "fit",
            "-c",
            DDP_YAML,
            "-c",
            str(PROFILE_YAML),
            "--trainer.accelerator=cpu",
            "--trainer.max_epochs=1",
            f"--trainer.limit_train_batches={batches + 1}",  # the recording ends inside the epoch
            "--trainer.limit_val_batches=2",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr

    run_dir = tmp_path / "logs" / "toy" / "default"
    for rank in range(2):
        traces = list(run_dir.glob(f"fit-profile-{rank}-*training_step.*.pt.trace.json"))
        assert len(traces) == 1, sorted(p.name for p in run_dir.iterdir())
        trace = json.loads(traces[0].read_text())
        assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2
        names = [event.get("name", "") for event in trace["traceEvents"]]
        recorded_steps = {name for name in names if name.startswith("ProfilerStep#")}
        assert len(recorded_steps) == schedule["active"], recorded_steps
        assert "[pl][profile][Strategy]DDPStrategy.training_step" in names
        assert "aten::addmm" in names  # the model's Linear layers
        assert (run_dir / f"fit-profile-{rank}.txt").read_text().startswith("FIT Profiler Report")


@pytest.mark.parametrize("setting", ["active=0", "wait=-1"])
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # nothing fails later in __del__
def test_an_impossible_schedule_names_the_setting(setting):
    name, value = setting.split("=")
    with pytest.raises(ValueError, match=f"trainer.profiler.{name} must be"):
        ScheduledProfiler(**{name: int(value)})


def test_the_template_profiles_nothing_and_a_profiler_given_in_its_place_sees_every_callbacks_hooks(run_cli):
    steps = [*SINGLE_PROCESS, "--trainer.max_steps=3", "--trainer.limit_val_batches=0", "--trainer.logger=false"]
    quiet = run_cli("fit", "-c", DDP_YAML, *steps)
    assert type(quiet.trainer.profiler) is NoProfiler
    assert quiet.trainer.profiler.profile("a") is quiet.trainer.profiler.profile("b")  # one object, nothing kept
    profiled = run_cli("fit", "-c", DDP_YAML, *steps, "--trainer.profiler=simple", "--ckpt_path=null")
    recorded = profiled.trainer.profiler.recorded_durations
    for callback in profiled.trainer.callbacks:
        assert len(recorded[f"[Callback]{callback.state_key}.on_before_zero_grad"]) == 3, callback.state_key
