"""The Dockerfile and .dockerignore, checked without a Docker engine: what the image installs, runs and contains."""

import inspect
import re
import shlex
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import yaml

from data import Seq2SeqDataModule
from tests.helpers import REPO

DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.MULTILINE)]


def arg_defaults() -> dict[str, str]:
    defaults = {}
    for instruction, args in instructions():
        if instruction == "ARG" and "=" in args:
            name, value = args.split("=", 1)
            defaults[name] = value.strip('"')
    return defaults


def test_the_image_installs_requirements_txt_itself_and_pins_nothing_else():
    steps = instructions()
    copied = [args.split() for instruction, args in steps if instruction == "COPY" and "requirements" in args]
    assert copied == [["requirements.txt", "/tmp/requirements.txt"]]
    runs = [args for instruction, args in steps if instruction == "RUN"]
    pip_installs = [re.search(r"pip install ([^&;]*)", run)[1].split() for run in runs if "pip install" in run]
    assert pip_installs == [["-r", "/tmp/requirements.txt"]]
    pin = re.compile(r"\b[A-Za-z0-9_.-]+(\[[\w,]+\])?(==|~=|>=|<=|!=)\S")
    assert not [run for run in runs if pin.search(run)], "a version pinned outside requirements.txt"


def test_the_image_has_what_the_launcher_calls():
    (apt,) = [args for instruction, args in instructions() if instruction == "RUN" and "apt-get install" in args]
    packages = set(re.search(r"apt-get install ([^&]*)", apt)[1].split())
    assert {"iproute2", "procps", "python3", "python3-venv"} <= packages  # ip and ss for scripts/run_ddp_train.sh


def test_the_image_has_the_verbs_libraries_nccl_needs_for_infiniband():
    (apt,) = [args for instruction, args in instructions() if instruction == "RUN" and "apt-get install" in args]
    packages = set(re.search(r"apt-get install ([^&]*)", apt)[1].split())
    # Without them NCCL falls back to TCP sockets, even with `docker run --device /dev/infiniband`.
    assert {"libibverbs1", "ibverbs-providers"} <= packages


def written_at_run_time() -> set[str]:
    """The directories, relative to the project, that training writes into: the logger's (checkpoints too), the
    node logs' and the seq2seq corpus'."""
    ddp = yaml.safe_load((REPO / "configs" / "ddp.yaml").read_text())
    settings = (REPO / "scripts" / "cluster.env").read_text().splitlines()
    node_logs = [line.split("=", 1)[1] for line in settings if line.startswith("LOG_DIR=")]
    seq2seq = yaml.safe_load((REPO / "configs" / "seq2seq.yaml").read_text())["data"]["init_args"]
    corpus = seq2seq.get("data_dir", inspect.signature(Seq2SeqDataModule).parameters["data_dir"].default)
    return {ddp["trainer"]["logger"]["init_args"]["save_dir"], *node_logs, corpus}


def test_the_user_owns_every_directory_training_writes_and_nothing_else():
    steps = instructions()
    workdir = PurePosixPath(dict(steps)["WORKDIR"])
    (user,) = [re.search(r"useradd ([^&;]*)", args)[1].split()[-1] for _, args in steps if "useradd" in args]
    owned = set()
    # Ownership given before `COPY . .` could be taken back by it.
    for instruction, args in steps[steps.index(("COPY", ". .")) :]:
        if instruction == "RUN":
            for paths in re.findall(rf"chown (?:-R )?{user}(?::{user})? ([^&;]+)", args):
                owned |= {workdir / path for path in paths.split()}
    for directory in written_at_run_time():
        path = workdir / directory
        assert any(path == mine or mine in path.parents for mine in owned), f"{path} is not {user}'s in the image"
    assert workdir not in owned, "the code should stay root's, out of reach of training"


def test_it_runs_cli_py_as_a_non_root_user():
    steps = instructions()
    names = [instruction for instruction, _ in steps]
    assert names.count("USER") == 1 and names.count("ENTRYPOINT") == 1
    assert names.index("USER") < names.index("ENTRYPOINT")
    user = dict(steps)["USER"]
    variable = re.fullmatch(r"\$\{?(\w+)\}?", user)
    uid = arg_defaults()[variable[1]] if variable else user
    assert uid.isdigit() and int(uid) != 0, f"USER {user} is root"
    uid_option = rf'--uid "?\$\{{?{variable[1]}\}}?"?' if variable else f"--uid {uid}"
    assert any(instruction == "RUN" and re.search(rf"useradd .*{uid_option}", args) for instruction, args in steps)

    assert shlex.split(dict(steps)["ENTRYPOINT"].strip("[]").replace(",", " ")) == ["python", "cli.py"]
    assert dict(steps)["WORKDIR"] == "/app" and ("COPY", ". .") in steps


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def excluded(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern decides, `!` re-includes, a matched directory covers its contents."""
    result = False
    parts = path.split("/")
    for pattern in patterns:
        negated = pattern.startswith("!")
        glob = pattern.lstrip("!").strip("/")
        regex = re.escape(glob).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        regex = regex.replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, "/".join(parts[:depth])) for depth in range(1, len(parts) + 1)):
            result = not negated
    return result


@pytest.mark.parametrize(
    "path",
    [
        "logs/toy/version_0/checkpoints/last.ckpt",
        "logs/nodes/node0.log",
        "slurm-ddp-42.out",
        "lightning_logs/version_0/hparams.yaml",
        "checkpoints/epoch=0-step=8.ckpt",
        "models/epoch001.ckpt",
        ".git/HEAD",
        ".venv/bin/python",
        "models/__pycache__/toy.cpython-311.pyc",
        ".pytest_cache/README.md",
    ],
)
def test_dockerignore_keeps_outputs_environments_and_caches_out(path):
    assert excluded(path, dockerignore_patterns())


def test_dockerignore_keeps_every_project_file_in():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    assert "cli.py" in tracked
    assert [path for path in tracked if excluded(path, dockerignore_patterns())] == []


def test_hadolint_finds_nothing():
    hadolint = Path(sys.executable).with_name("hadolint")
    result = subprocess.run([str(hadolint), str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def documented_docker_commands() -> list[list[str]]:
    page = (REPO / "docs" / "multi-node.md").read_text()
    section = page.split("\n## Docker\n", 1)[1].split("\n## ", 1)[0]  # the Docker section, to the next one
    blocks = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.startswith("docker ")]


def test_documented_docker_commands_match_the_image():
    commands = documented_docker_commands()
    (build,) = [c for c in commands if c[1] == "build"]
    image = build[build.index("-t") + 1]
    runs = [c for c in commands if c[1] == "run"]
    workdir = dict(instructions())["WORKDIR"]
    launcher_runs = []
    for run in runs:
        volumes = dict(run[i + 1].split(":")[:2] for i, word in enumerate(run) if word == "-v")
        assert volumes["$PWD/logs"] == f"{workdir}/logs", run
        after_image = run[run.index(image) + 1 :]
        if "--entrypoint" in run:
            entrypoint = run[run.index("--entrypoint") + 1]
            assert entrypoint == f"{workdir}/scripts/run_ddp_train.sh"
            assert (REPO / "scripts" / "run_ddp_train.sh").stat().st_mode & 0o111
            assert {"--network", "--ipc", "--gpus"} <= set(run)
            assert run[run.index("--network") + 1] == "host" and run[run.index("--ipc") + 1] == "host"
            assert run[run.index("--env-file") + 1] == "scripts/cluster.env"
            assert volumes["$PWD/scripts/cluster.env"] == f"{workdir}/scripts/cluster.env"
            launcher_runs.append(after_image)
        else:
            assert after_image[0] == "fit" and (REPO / after_image[after_image.index("-c") + 1]).is_file()
    assert sorted(args[1] for args in launcher_runs) == ["0", "1"]  # a master and a worker
