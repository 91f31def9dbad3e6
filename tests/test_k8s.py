"""The Kubernetes manifests of scripts/k8s: what they declare, the commands and environments their pods get
(tests/helpers/k8s_pods.py plays Kubeflow's part), and two pods of each kind simulated as processes on this machine."""

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from torch.distributed.run import parse_args

from tests.helpers import REPO, copy_project, free_port, probe_args, probe_records
from tests.helpers.k8s_pods import K8S, Pod, load, node_template, pytorchjob_pods, trainjob_pods

NUM_TRAIN = 4096  # 16 steps per epoch on each of 4 ranks
HOLD_STEP = 18  # in the second epoch: the first one's last.ckpt is on the shared volume


def pods_of(kind: str, edit=None) -> list[Pod]:
    """The pods of a manifest kind (``trainjob`` or ``pytorchjob``), after ``edit`` changed the manifests."""
    manifests = {
        "runtime": load("runtime.yaml"),
        "trainjob": load("trainjob.yaml"),
        "pytorchjob": load("pytorchjob.yaml"),
    }
    if edit:
        edit(manifests)
    if kind == "trainjob":
        return trainjob_pods(manifests["runtime"], manifests["trainjob"])
    return pytorchjob_pods(manifests["pytorchjob"])


def node_counts(kind: str) -> tuple[int, int]:
    """Nodes and processes per node as the manifest writes them."""
    if kind == "trainjob":
        trainer = load("trainjob.yaml")["spec"]["trainer"]
        return trainer["numNodes"], trainer["numProcPerNode"]
    spec = load("pytorchjob.yaml")["spec"]
    return sum(r["replicas"] for r in spec["pytorchReplicaSpecs"].values()), int(spec["nprocPerNode"])


def test_every_manifest_parses_and_names_the_api_it_is_for():
    kinds = {
        path.name: [(d["apiVersion"], d["kind"]) for d in yaml.safe_load_all(path.read_text())]
        for path in K8S.glob("*.yaml")
    }
    assert kinds == {
        "runtime.yaml": [("trainer.kubeflow.org/v1alpha1", "TrainingRuntime")],
        "trainjob.yaml": [("trainer.kubeflow.org/v1alpha1", "TrainJob")],
        "pytorchjob.yaml": [("kubeflow.org/v1", "PyTorchJob")],
        "volume.yaml": [("v1", "PersistentVolumeClaim")],
    }
    runtime, trainjob = load("runtime.yaml"), load("trainjob.yaml")
    assert trainjob["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
        "name": runtime["metadata"]["name"],
    }
    assert "torch" in runtime["spec"]["mlPolicy"]
    # A failed pod fails the job at once, and JobSet then restarts every pod, after the old ones are gone.
    jobset = runtime["spec"]["template"]["spec"]
    assert (
        jobset["failurePolicy"]["maxRestarts"] >= 1 and jobset["failurePolicy"]["restartStrategy"] == "BlockingRecreate"
    )
    assert jobset["replicatedJobs"][0]["template"]["spec"]["backoffLimit"] == 0
    claim = load("volume.yaml")["metadata"]["name"]
    pytorchjob = load("pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"]
    for template in (node_template(runtime), pytorchjob["Master"]["template"], pytorchjob["Worker"]["template"]):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        (container,) = template["spec"]["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/app/logs"]]["persistentVolumeClaim"]["claimName"] == claim
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert container["workingDir"] == "/app"


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_each_pod_gets_the_nccl_settings_of_cluster_env_and_the_jobs_name_as_run_id(kind):
    settings = dict(
        line.split("=", 1) for line in (REPO / "scripts" / "cluster.env").read_text().splitlines() if line[:1].isalpha()
    )
    nccl = {key: value for key, value in settings.items() if key.startswith("NCCL_") and value}
    assert nccl
    for pod in pods_of(kind):
        assert {key: pod.env.get(key) for key in nccl} == nccl
        assert pod.env["RUN_ID"] == "ddp"


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_torchrun_and_lightning_in_each_pod_count_the_nodes_and_gpus_of_the_manifest(kind, monkeypatch, run_cli):
    nodes, per_node = node_counts(kind)
    pods = pods_of(kind)
    assert len(pods) == nodes >= 2 and per_node >= 2
    assert [pod.node_rank for pod in pods] == list(range(nodes))
    monkeypatch.chdir(REPO)  # the pod's workingDir, /app in the image
    for pod in pods:
        assert pod.command[0] == "torchrun" and pod.gpus == per_node
        for key, value in pod.env.items():
            monkeypatch.setenv(key, value)
        torchrun = parse_args(pod.command[1:])  # torchrun's options take their defaults from PET_*
        assert (torchrun.nnodes, torchrun.nproc_per_node, torchrun.node_rank) == (
            str(nodes),
            str(per_node),
            pod.node_rank,
        )
        assert (torchrun.rdzv_backend, torchrun.master_addr) == ("static", pods[0].address)
        assert torchrun.training_script == "cli.py"
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), pytest.raises(SystemExit):
            run_cli(*torchrun.training_script_args, "--print_config")
        trainer = yaml.safe_load(printed.getvalue())["trainer"]
        # A number on the command line stays a string for trainer.devices ("4"), which Lightning reads as 4.
        assert (trainer["num_nodes"], int(trainer["devices"])) == (nodes, per_node)


def on_cpu(kind: str, per_node: int, *args: str):
    """Edit the manifests as for a cluster without GPUs: ``per_node`` processes per pod, ``args`` for cli.py."""

    def edit(manifests: dict) -> None:
        if kind == "trainjob":
            trainer = manifests["trainjob"]["spec"]["trainer"]
            trainer.update(numProcPerNode=per_node, resourcesPerNode={}, args=list(args))
        else:
            spec = manifests["pytorchjob"]["spec"]
            spec["nprocPerNode"] = str(per_node)
            for replica in spec["pytorchReplicaSpecs"].values():  # one template, shared by a YAML anchor
                (container,) = replica["template"]["spec"]["containers"]
                container.pop("resources", None)
                container["args"] = list(args)

    return edit


def start(pods: list[Pod], root: Path, attempt: str) -> list[subprocess.Popen]:
    """Each pod as a process. Every pod runs the image's /app, whose logs/ is the volume they share: here one copy
    of the project serves them all. The pod network is loopback here: the master pod's name resolves to 127.0.0.1
    (with a free port), and gloo's interface is lo instead of the pod's eth0."""
    app = root / "app"
    if not app.exists():
        copy_project(app)
    port = str(free_port())
    network = {"PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port, "GLOO_SOCKET_IFNAME": "lo"}
    started = []
    for pod in pods:
        env = {**pod.env, **network}
        if "MASTER_ADDR" in env:  # the v1 operator sets the pod's own MASTER_ADDR and MASTER_PORT too
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        # What the image and Kubernetes set in every container: the virtualenv on PATH, the pod's host name.
        image = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": os.environ["HOME"]}
        image |= {"PYTHONUNBUFFERED": "1", "HOSTNAME": hostname(pod)}
        with open(root / f"pod{pod.node_rank}-{attempt}.log", "w") as log:
            started.append(
                subprocess.Popen(pod.command, cwd=app, env={**image, **env}, stdout=log, stderr=subprocess.STDOUT)
            )
    return started


def hostname(pod: Pod) -> str:
    return pod.address.split(".")[0]


def processes_of(pod: Pod) -> list[int]:
    """Every process of the pod: those with its HOSTNAME, torchrun's workers in their own sessions included."""
    marker = f"HOSTNAME={hostname(pod)}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def finish(processes: list[subprocess.Popen], timeout: float = 600) -> list[int]:
    deadline = time.monotonic() + timeout
    for process in processes:
        process.wait(timeout=max(1, deadline - time.monotonic()))
    return [process.returncode for process in processes]


@pytest.fixture(scope="module")
def trainjob(tmp_path_factory):
    """A TrainJob of 2 pods x 2 processes that loses pod 1 in its second epoch and is restarted as JobSet does
    (every pod deleted, then created again): each attempt's pod logs, and the probe's directory."""
    root = tmp_path_factory.mktemp("trainjob")
    hold = root / "kill.hold"
    hold.touch()
    args = ["--trainer.max_epochs=2", f"--data.init_args.num_train={NUM_TRAIN}", *probe_args(root / "probe")]
    args += ["--trainer.callbacks+=tests.helpers.probe.HoldAtStep", f"--trainer.callbacks.step={HOLD_STEP}"]
    pods = pods_of("trainjob", on_cpu("trainjob", 2, *args, f"--trainer.callbacks.hold_file={hold}"))
    first = start(pods, root, "first")
    deadline = time.monotonic() + 600
    while not all(Path(f"{hold}.rank{rank}").exists() for rank in range(4)):
        assert all(p.poll() is None for p in first), (
            "a pod ended before holding: " + (root / "pod0-first.log").read_text()
        )
        assert time.monotonic() < deadline, "the pods never held at their step"
        time.sleep(0.1)
    for pid in processes_of(pods[1]):  # the node of pod 1 is lost: every process of the pod is gone
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    hold.unlink()
    first_status = finish(first)
    second = start(pods, root, "second")
    second_status = finish(second)
    logs = {name: (root / f"{name}.log").read_text() for name in ("pod0-first", "pod0-second", "pod1-second")}
    return root, first_status, second_status, logs


@pytest.mark.distributed
def test_a_trainjob_restarted_after_losing_a_pod_resumes_and_finishes(trainjob):
    root, first_status, second_status, logs = trainjob
    assert first_status[0] != 0 and first_status[1] == -signal.SIGKILL, logs["pod0-first"]
    assert second_status == [0, 0], logs["pod0-second"] + logs["pod1-second"]
    resumed = rf"Resuming from \S+/toy/ddp/checkpoints/last\.ckpt \(epoch 0, step {NUM_TRAIN // 256}\)\."
    assert re.search(resumed, logs["pod0-second"]), logs["pod0-second"]
    assert (root / "app" / "logs" / "toy" / "ddp" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.distributed
def test_lightning_takes_world_size_node_rank_and_global_ranks_from_torchrun_in_a_trainjob(trainjob):
    records = probe_records(trainjob[0] / "probe", 4)
    assert [(r["global_rank"], r["node_rank"], r["local_rank"], r["world_size"]) for r in records] == [
        (0, 0, 0, 4),
        (1, 0, 1, 4),
        (2, 1, 0, 4),
        (3, 1, 1, 4),
    ]
    for record in records[1:]:
        for name, value in records[0]["params"].items():
            assert (value == record["params"][name]).all(), name


@pytest.mark.distributed
def test_lightning_takes_world_size_node_rank_and_global_ranks_from_torchrun_in_a_pytorchjob(tmp_path):
    args = ["--trainer.max_epochs=1", "--data.init_args.num_train=1024", *probe_args(tmp_path / "probe")]
    pods = pods_of("pytorchjob", on_cpu("pytorchjob", 1, *args))
    assert [pod.env["RANK"] for pod in pods] == ["0", "1"], "the operator's RANK is the pod's, torchrun's the process's"
    status = finish(start(pods, tmp_path, "only"))
    assert status == [0, 0], (tmp_path / "pod0-only.log").read_text()
    records = probe_records(tmp_path / "probe", 2)
    assert [(r["global_rank"], r["node_rank"], r["local_rank"], r["world_size"]) for r in records] == [
        (0, 0, 0, 2),
        (1, 1, 0, 2),
    ]
    assert (tmp_path / "app" / "logs" / "toy" / "ddp" / "checkpoints" / "last.ckpt").is_file()
