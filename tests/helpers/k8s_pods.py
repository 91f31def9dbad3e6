"""The pods Kubeflow makes of the manifests in scripts/k8s, without a cluster: each pod's command and the
environment its container gets, as Kubeflow Trainer v2 (a TrainJob on JobSet) and the Training Operator v1
(PyTorchJob) set them, from their sources (kubeflow/trainer: pkg/runtime/framework/plugins/torch/torch.go on
master, pkg/controller.v1/pytorch/envvar.go and master.go on release-1.9)."""

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parents[2] / "scripts" / "k8s"
ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
V2_PORT = 29500  # Kubeflow Trainer's ContainerTrainerPort


@dataclass
class Pod:
    address: str  # the pod's name in the cluster's DNS
    node_rank: int
    command: list[str]
    env: dict[str, str]
    gpus: int


def load(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


def expand(words: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' expansion of a container's command and args: ``$(VAR)`` by its value where the container
    defines VAR, left as written where not; ``$$`` is a literal ``$``."""

    def value(match: re.Match) -> str:
        return "$" if match[0] == "$$" else env.get(match[1], match[0])

    return [re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, word) for word in words]


def resolve(entries: list[dict], labels: dict[str, str], annotations: dict[str, str]) -> dict[str, str]:
    """A container's ``env`` list as values; a later entry of a name replaces an earlier one (Kubeflow upserts)."""
    fields = {f"metadata.labels['{k}']": v for k, v in labels.items()}
    fields |= {f"metadata.annotations['{k}']": v for k, v in annotations.items()}
    env = {}
    for entry in entries:
        if "valueFrom" in entry:
            env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[entry["name"]] = str(entry.get("value", ""))
    return env


def node_template(runtime: dict) -> dict:
    """The pod template of the runtime's trainer job: the replicated job Kubeflow finds by its ancestor label."""
    jobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    (job,) = [job for job in jobs if job["template"]["metadata"]["labels"].get(ANCESTOR) == "trainer"]
    return job["template"]["spec"]["template"]


def trainjob_pods(runtime: dict, trainjob: dict) -> list[Pod]:
    """One Job of ``numNodes`` indexed pods; the node rank is the pod's completion index."""
    name, trainer = trainjob["metadata"]["name"], trainjob["spec"]["trainer"]
    (container,) = [c for c in node_template(runtime)["spec"]["containers"] if c["name"] == "node"]
    num_nodes = trainer.get("numNodes", runtime["spec"]["mlPolicy"].get("numNodes", 1))
    nproc = trainer["numProcPerNode"]
    injected = [
        {"name": "PET_NNODES", "value": str(num_nodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(nproc)},
        {
            "name": "PET_NODE_RANK",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}},
        },
        {"name": "PET_MASTER_ADDR", "value": f"{name}-node-0-0.{name}"},
        {"name": "PET_MASTER_PORT", "value": str(V2_PORT)},
    ]
    gpus = int(trainer.get("resourcesPerNode", {}).get("limits", {}).get("nvidia.com/gpu", 0))
    pods = []
    for index in range(num_nodes):
        labels = {"jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/replicatedjob-name": "node"}
        env = resolve(
            [*container.get("env", []), *trainer.get("env", []), *injected], labels, {COMPLETION_INDEX: str(index)}
        )
        command = [*trainer.get("command", container["command"]), *trainer.get("args", container.get("args", []))]
        pods.append(Pod(f"{name}-node-0-{index}.{name}", index, expand(command, env), env, gpus))
    return pods


def pytorchjob_pods(job: dict) -> list[Pod]:
    """A Master pod (node rank 0) and Worker pods (node ranks 1, 2, ...)."""
    name, spec = job["metadata"]["name"], job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    total = sum(replicas[kind]["replicas"] for kind in replicas)
    nproc = spec.get("nprocPerNode")
    pods = []
    for kind in ("Master", "Worker"):
        template = replicas[kind]["template"]
        (container,) = [c for c in template["spec"]["containers"] if c["name"] == "pytorch"]
        (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "pytorchjob-port"]
        for index in range(replicas[kind]["replicas"]):
            rank = index + (kind == "Worker")
            injected = {
                "PYTHONUNBUFFERED": "1",
                "MASTER_PORT": str(port),
                "PET_MASTER_PORT": str(port),
                "MASTER_ADDR": f"{name}-master-0",
                "PET_MASTER_ADDR": f"{name}-master-0",
                "WORLD_SIZE": str(total * int(nproc or 1)),
                "RANK": str(rank),
                "PET_NODE_RANK": str(rank),
                **({"PET_NPROC_PER_NODE": nproc} if nproc is not None else {}),
                "PET_NNODES": str(total),
            }
            labels = {
                "training.kubeflow.org/job-name": name,
                "training.kubeflow.org/replica-type": kind.lower(),
                "training.kubeflow.org/replica-index": str(index),
            }
            entries = [*container.get("env", []), *({"name": k, "value": v} for k, v in injected.items())]
            env = resolve(entries, labels, {})
            gpus = int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
            command = [*container["command"], *container.get("args", [])]
            pods.append(Pod(f"{name}-{kind.lower()}-{index}", rank, expand(command, env), env, gpus))
    return pods
