"""The user's environment: the supported range of Python and packages, checked first by cli.py and the launchers;
the install that keeps a torch in that range; NVIDIA GPUs that this torch cannot use."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.accelerators import CUDAAccelerator

from scripts import install
from tests.helpers import DDP_YAML, REPO, SINGLE_PROCESS, run_script
from training.config import gpu_support
from training.job import versions

OLDER_PYTHON = Path("/root/.pyenv/versions/3.10.13/bin/python")
CAPTURED = {"capture_output": True, "text": True, "timeout": 300}


def shadowing(tmp_path: Path, name: str, version: str) -> dict[str, str]:
    """An environment whose Python finds ``name`` at ``version`` first: its dist-info ahead of site-packages, as an
    install of that release would have it (the real package still imports: the check reads metadata only)."""
    info = tmp_path / "shadow" / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return {"PYTHONPATH": f"{info.parent}:{REPO}"}


def test_the_lock_is_inside_the_supported_range_and_not_newer_than_tested():
    assert versions.refusal() is None
    assert versions.newer_than_tested() == []
    pins = re.findall(r"^([\w.-]+)(?:\[.*\])?==(\S+)", (REPO / "requirements.txt").read_text(), re.MULTILINE)
    lock = dict(pins)
    _, ranges, newest, _ = versions.supported()
    for name, specifier in ranges.items():
        assert versions.allows(specifier, lock[name]), f"requirements.txt's {name}=={lock[name]} is not {specifier}"
        assert versions.release(lock[name])[: len(versions.release(newest[name]))] <= versions.release(newest[name])


def test_the_pythons_whose_forks_can_hang_are_named_for_the_doctor():
    (note,) = versions.known_bugs((3, 11, 2))
    assert note.startswith("note: Python 3.11.2 can leave a process forked beside a thread") and "gh-112275" in note
    assert versions.known_bugs((3, 11, 10)) == versions.known_bugs((3, 12, 1)) == []


@pytest.mark.parametrize(
    "specifier, version, inside",
    [
        (">=2.8", "2.11.0+cu128", True),
        (">=2.8", "2.8.0a0+gitabc", True),
        (">=2.8", "2.5.1", False),
        (">=2.5,!=2.6.2,!=2.6.3", "2.6.2", False),
        (">=2.5,!=2.6.2,!=2.6.3", "2.5.0.post0", True),
        (">=2.5.1", "2.5.0.post0", False),
        (">=4.53", "4.9.0", False),  # numbers, not text
    ],
)
def test_a_range_is_compared_by_release_numbers(specifier, version, inside):
    assert versions.allows(specifier, version) is inside


def test_an_older_torch_stops_cli_py_before_its_imports_naming_the_range_and_the_install(tmp_path):
    run = run_script(
        [str(REPO / "cli.py"), "fit", "-c", DDP_YAML], cwd=tmp_path, env=shadowing(tmp_path, "torch", "2.5.1")
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "error: torch 2.5.1 is outside the range the template supports (torch>=2.8: the oldest release the template is "
        "tested with). Install the versions the template is tested with: python -m scripts.install (it keeps a torch "
        "in the range, and its CUDA build; docs/versions.md says how to choose another build), or pip install "
        "'torch>=2.8'. Nothing was started."
    ]
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("script", ["run_ddp_train.sh", "doctor.sh"])
def test_the_launcher_and_the_doctor_refuse_a_withdrawn_lightning_first(tmp_path, script):
    env = shadowing(tmp_path, "lightning", "2.6.2")
    run = subprocess.run(
        [str(REPO / "scripts" / script), "cpu:2", "0"], cwd=REPO, env={**run_script_env(), **env}, **CAPTURED
    )
    assert run.returncode == 2
    assert run.stdout == ""  # nothing checked, nothing launched
    assert run.stderr.startswith("error: lightning 2.6.2 is outside the range the template supports (lightning>=2.5.2,")
    assert "2.6.2 and 2.6.3 were withdrawn" in run.stderr and "python -m scripts.install" in run.stderr


def test_a_newer_release_runs_with_one_line_said_once(tmp_path):
    env = shadowing(tmp_path, "torch", "2.16.0")
    run = run_script([str(REPO / "cli.py"), "fit", "-c", DDP_YAML, "--print_config"], cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == [
        "note: torch 2.16.0 is newer than the newest release this template was tested with (2.15, docs/versions.md): "
        "it should work; what does not is worth an issue."
    ]
    assert "trainer:" in run.stdout


def test_a_missing_package_is_named_with_this_python(monkeypatch):
    monkeypatch.setattr(versions, "installed", lambda name: None if name == "omegaconf" else "99.0")
    assert versions.refusal() == (
        f"omegaconf is not installed in this Python ({sys.executable}). Install the versions the template is tested "
        "with: python -m scripts.install (it keeps a torch in the range, and its CUDA build; docs/versions.md says how "
        "to choose another build), or pip install 'omegaconf>=2.4'. Nothing was started."
    )


@pytest.mark.skipif(not OLDER_PYTHON.exists(), reason=f"no Python 3.10 at {OLDER_PYTHON}")
def test_python_3_10_is_refused_with_the_reason(tmp_path):
    run = subprocess.run([str(OLDER_PYTHON), "cli.py", "fit"], cwd=REPO, **CAPTURED)
    assert run.returncode == 2
    assert run.stderr.startswith("error: Python 3.10.13 is outside the range the template supports (Python>=3.11: ")
    assert "python3.12 -m venv .venv" in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_the_install_keeps_a_torch_in_the_range_and_its_cuda_build(tmp_path):
    env = shadowing(tmp_path, "torch", "2.11.0+cu128")
    # pip resolves against what this Python has, the shadowing torch included: --dry-run says what it would install.
    run = subprocess.run(
        [sys.executable, "-m", "scripts.install", "--dry-run"], cwd=REPO, env={**run_script_env(), **env}, **CAPTURED
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == (
        "keeping torch 2.11.0+cu128 (in the supported range torch>=2.8; the tests ran with 2.13.0)"
    )
    would_install = " ".join(line for line in run.stdout.splitlines() if line.startswith("Would install "))
    assert not re.search(r"\btorch-\d", would_install), would_install


@pytest.mark.parametrize("torch_version", [None, "2.5.1"])
def test_the_install_takes_the_tested_torch_without_one_or_for_one_outside_the_range(tmp_path, torch_version):
    arguments, told = install.pip_arguments(torch_version, tmp_path)
    assert arguments == ["-r", str(REPO / "requirements.txt")]
    assert told.endswith("2.13.0, the one the tests ran with")
    assert ("outside the range" in told) == (torch_version is not None)


def test_the_install_pins_everything_else_of_the_lock_beside_a_kept_torch(tmp_path):
    arguments, _ = install.pip_arguments("2.11.0+cu128", tmp_path)
    assert arguments == ["-r", str(tmp_path / "requirements.txt"), "-c", str(tmp_path / "constraints.txt")]
    lock = [line for line in (REPO / "requirements.txt").read_text().splitlines() if not line.startswith("torch==")]
    assert (tmp_path / "requirements.txt").read_text().splitlines() == lock
    assert (tmp_path / "constraints.txt").read_text() == "torch==2.11.0\n"


@pytest.mark.parametrize(
    ("banner", "version"),
    [
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023", "535.104.05"),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build", "570.86.15"),
        (None, None),
    ],
    ids=["kernel module", "open kernel module", "no driver"],
)
def test_the_driver_version_is_read_from_its_kernel_module(banner, version, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_support, "DRIVER", tmp_path / "version")
    if banner:
        gpu_support.DRIVER.write_text(f"{banner}\nGCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n")
    assert gpu_support.driver_version() == version


@pytest.fixture
def nvidia_driver(tmp_path, monkeypatch):
    """This node as one with the NVIDIA driver 570.124.06 loaded, whose torch sees no GPU."""
    banner = tmp_path / "version"
    banner.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Wed Feb 26 2025\nGCC version: 12\n")
    monkeypatch.setattr(gpu_support, "DRIVER", banner)
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: False))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_gpus_a_cuda_build_newer_than_the_driver_cannot_use_stop_the_run_instead_of_training_on_cpu(
    run_cli, capsys, monkeypatch, nvidia_driver
):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(SystemExit) as exit_:
        run_cli("fit", "-c", DDP_YAML)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: this node has NVIDIA GPUs (driver 570.124.06 is loaded), but torch {torch.__version__} cannot use "
        "them: it is built for CUDA 13.0, which needs driver 580 or newer. With trainer.accelerator=auto the run would "
        "train on the CPU instead. To train on the GPUs, install a torch built for a CUDA version this driver runs (or "
        "update the driver): docs/versions.md shows how to pick the build for a driver (nvidia-smi shows the driver "
        "and the newest CUDA version it runs). To train on the CPU on purpose, set trainer.accelerator=cpu (the "
        "launcher's cpu:N). Nothing was started."
    )


def test_gpus_beside_a_cpu_build_are_named_and_cpu_on_purpose_still_trains(run_cli, monkeypatch, nvidia_driver):
    monkeypatch.setattr(torch.version, "cuda", None)
    problem = gpu_support.unusable_gpus_problem({"trainer": {"accelerator": "gpu"}})
    assert "cannot use them: it is a CPU build, without CUDA. With trainer.accelerator=gpu" in problem
    assert f"install a CUDA build of torch {torch.__version__.split('+')[0]}:" in problem
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hidden on purpose
    assert gpu_support.unusable_gpus_problem({"trainer": {"accelerator": "auto"}}) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    args = ("fit", "-c", DDP_YAML, *SINGLE_PROCESS, "--trainer.accelerator=cpu", "--trainer.fast_dev_run=1")
    assert run_cli(*args).trainer.global_step == 1


def run_script_env() -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable}
