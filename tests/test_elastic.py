"""Elastic continuation on three network-namespace hosts (LAUNCHER=torchrun, MIN_NODES=2, one process each),
streaming a shard directory with a global batch of 24, and a 2-node job resumed on 1 node by hand.

The elastic run: the three nodes hold 6 steps into epoch 1; host 3's link is cut there; hosts 1
and 2 go on from the last checkpoint at world size 2 and hold again 4 steps later; host 3's launcher, stopped
meanwhile, is started again once its link is back, and the job goes on at world size 3 until it ends. Every
rank logs the pairs of each batch it trains (tests.helpers.probe.SampleLog), so the tests can rebuild the training the
job kept (for each step, the last attempt that trained it) and check it pair by pair.
"""

import json
import signal
import subprocess
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

from scripts import make_shards
from tests.helpers import copy_project, free_port, launch, write_pairs

pytestmark = pytest.mark.distributed

GLOBAL_BATCH = 24
EPOCHS = 2
CHECKPOINT_EVERY = 3
PEER_TIMEOUT = 10  # seconds, a setting of these runs
ELASTIC_WAIT = 20  # seconds the rendezvous waits for more nodes once two are there
NUM_TRAIN = 573  # pairs to train on, of the 600 the module's shards hold
STEPS_PER_EPOCH = NUM_TRAIN // GLOBAL_BATCH + 1  # the last one partial
MARGIN = 180  # seconds a restart may take on a busy machine, on top of peer_timeout and the rendezvous
CONFIGS = "configs/step_checkpoints.yaml configs/seq2seq.yaml configs/elastic.yaml"
SMALL = [
    "--trainer.accelerator=cpu",
    f"--trainer.max_epochs={EPOCHS}",
    "--data.init_args.path=shards",
    "--data.init_args.val_fraction=0.045",
    "--model.init_args.d_model=32",
    "--model.init_args.num_encoder_layers=1",
    "--model.init_args.num_decoder_layers=1",
    "--model.init_args.dim_feedforward=64",
    "--model.init_args.warmup_steps=10",
    f"--trainer.callbacks.size={GLOBAL_BATCH}",  # training.GlobalBatch, the last callback of configs/elastic.yaml
    f"--trainer.strategy.init_args.peer_timeout=0:00:{PEER_TIMEOUT:02d}",
]


def start(project: Path, rank: int, log: Path, *args: str, netns: str | None = None, **settings: str):
    return launch(project, "cpu:1", rank, *SMALL, *args, netns=netns, log=log, CONFIGS=CONFIGS, **settings)


def held(hold: Path, ranks: int, launchers: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + 600
    while not all(Path(f"{hold}.rank{rank}").exists() for rank in range(ranks)):
        for launcher, log in zip(launchers, logs, strict=True):
            assert launcher.poll() is None, f"a node ended before holding at {hold.name}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"the job never held at {hold.name}"
        time.sleep(0.05)


def kept_training(log_dir: Path) -> tuple[list[int], dict[int, dict]]:
    """The world size of each attempt that trained, in order, and for every step the batches of the last attempt
    that trained it (a step trained again after a restart replaces the attempt that did not keep it)."""
    records = [json.loads(line) for path in log_dir.glob("*.jsonl") for line in path.read_text().splitlines()]
    attempts = sorted({(r["attempt"], r["world_size"]) for r in records})
    steps: dict[int, dict] = {}
    for attempt, world_size in attempts:
        batches = defaultdict(list)
        for r in records:
            if r["attempt"] == attempt:
                batches[r["step"]].append(r)
        for step, trained in batches.items():
            steps[step] = {"world_size": world_size, "epoch": trained[0]["epoch"], "ranks": trained}
    return [world_size for _, world_size in attempts], steps


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The project, with 600 pairs in shards (573 to train on: 23 steps of 24 and a partial one per epoch) and a
    copy of configs/ddp.yaml that checkpoints every CHECKPOINT_EVERY steps."""
    project = copy_project(tmp_path_factory.mktemp("elastic") / "project")
    pairs = write_pairs(project / "pairs.tsv", 600)
    assert make_shards.main([str(pairs), str(project / "shards"), "--shard-size=100", "--val-fraction=0.045"]) == 0
    ddp = (project / "configs" / "ddp.yaml").read_text()
    every = "every_n_train_steps: null"
    assert every in ddp
    (project / "configs" / "step_checkpoints.yaml").write_text(
        ddp.replace(every, f"every_n_train_steps: {CHECKPOINT_EVERY}")
    )
    return project


@pytest.fixture(scope="module")
def elastic(project, tmp_path_factory):
    from tests.helpers.hosts import network_namespaces, set_link

    root = tmp_path_factory.mktemp("run")
    with network_namespaces(f"{time.monotonic_ns() % 100000}e", count=3) as hosts:
        settings = {
            "MASTER_ADDR": hosts[0]["address"],
            "MASTER_PORT": "29500",
            "NUM_NODES": "3",
            "MIN_NODES": "2",
            "LAUNCHER": "torchrun",
            "ELASTIC_WAIT": str(ELASTIC_WAIT),
            "STOP_TIMEOUT": "10",
            "RUN_ID": "elastic",
        }
        first, second = root / "three.hold", root / "two.hold"
        first.touch()
        second.touch()
        args = [
            "--trainer.callbacks+=tests.helpers.probe.SampleLog",
            f"--trainer.callbacks.out_dir={root / 'samples'}",
            "--trainer.callbacks+=tests.helpers.probe.HoldAtStep",
            f"--trainer.callbacks.step={STEPS_PER_EPOCH + 6}",
            f"--trainer.callbacks.hold_file={first}",
            "--trainer.callbacks.world_size=3",
            "--trainer.callbacks+=tests.helpers.probe.HoldAtStep",
            f"--trainer.callbacks.step={STEPS_PER_EPOCH + 10}",
            f"--trainer.callbacks.hold_file={second}",
            "--trainer.callbacks.world_size=2",
        ]
        logs = [root / f"host{n}.log" for n in range(3)]
        launchers = [start(project, n, logs[n], *args, netns=hosts[n]["netns"], **settings) for n in range(3)]
        held(first, 3, launchers, logs)

        set_link(hosts[2], "down")
        cut_at = time.monotonic()
        first.unlink()
        held(second, 2, launchers[:2], logs[:2])
        continued_after = time.monotonic() - cut_at

        launchers[2].send_signal(signal.SIGTERM)  # the cut-off node, wherever it got to alone
        lost_status = launchers[2].wait(timeout=600)
        set_link(hosts[2], "up")
        logs.append(root / "host2-again.log")
        launchers.append(start(project, 2, logs[3], *args, netns=hosts[2]["netns"], **settings))
        statuses = [launcher.wait(timeout=900) for launcher in launchers]
        second.unlink()
    checkpoint = project / "logs" / "seq2seq" / "elastic" / "checkpoints" / "last.ckpt"
    return {
        "statuses": statuses,
        "lost_status": lost_status,
        "logs": [log.read_text() for log in logs],
        "continued_after": continued_after,
        "training": kept_training(root / "samples"),
        "final": torch.load(checkpoint, weights_only=True),
        "changes": 2,
    }


@pytest.fixture(scope="module")
def by_hand(project, tmp_path_factory):
    """Two nodes over loopback (Lightning's launcher) stopped by SIGTERM 6 steps into epoch 1, as a scheduler stops
    a job, then resumed by hand on one node."""
    root = tmp_path_factory.mktemp("by_hand")
    hold = root / "two.hold"
    hold.touch()
    settings = {"MASTER_PORT": str(free_port()), "RUN_ID": "by-hand", "STOP_TIMEOUT": "60"}
    args = [
        "--trainer.callbacks+=tests.helpers.probe.SampleLog",
        f"--trainer.callbacks.out_dir={root / 'samples'}",
        "--trainer.callbacks+=tests.helpers.probe.HoldAtStep",
        f"--trainer.callbacks.step={STEPS_PER_EPOCH + 6}",
        f"--trainer.callbacks.hold_file={hold}",
    ]
    logs = [root / f"node{n}.log" for n in range(3)]
    launchers = [start(project, n, logs[n], *args, NUM_NODES="2", **settings) for n in range(2)]
    held(hold, 2, launchers, logs[:2])
    for launcher in launchers:
        launcher.send_signal(signal.SIGTERM)
    stopped = [launcher.wait(timeout=600) for launcher in launchers]
    resumed = start(project, 0, logs[2], *args, NUM_NODES="1", **settings).wait(timeout=900)
    checkpoint = project / "logs" / "seq2seq" / "by-hand" / "checkpoints" / "last.ckpt"
    return {
        "statuses": [*stopped, resumed],
        "logs": [log.read_text() for log in logs],
        "training": kept_training(root / "samples"),
        "final": torch.load(checkpoint, weights_only=True),
        "changes": 1,
    }


@pytest.fixture(params=["elastic", "by_hand"])
def run(request):
    return request.getfixturevalue(request.param)


def test_the_job_goes_on_without_the_lost_node_and_takes_it_back_and_every_node_finishes(elastic):
    for node, (status, log) in enumerate(zip(elastic["statuses"], elastic["logs"], strict=True)):
        assert status == 0 or node == 2, log  # 2: the launcher stopped while its host was cut off
    worlds, _ = elastic["training"]
    assert worlds == [3, 2, 3], f"attempts trained at world sizes {worlds}"
    assert elastic["continued_after"] < PEER_TIMEOUT + ELASTIC_WAIT + MARGIN


def test_a_job_stopped_on_two_nodes_resumes_on_one_and_finishes(by_hand):
    for status, log in zip(by_hand["statuses"], by_hand["logs"], strict=True):
        assert status == 0, log
    assert "Global batch 24: 1 process(es) x batch_size 24 x 1 accumulated" in by_hand["logs"][2]
    worlds, _ = by_hand["training"]
    assert worlds == [2, 1], f"attempts trained at world sizes {worlds}"


def test_every_step_trains_one_global_batch_and_the_steps_run_on(run):
    _, steps = run["training"]
    assert sorted(steps) == list(range(run["final"]["global_step"]))
    for step, trained in steps.items():
        assert len(trained["ranks"]) == trained["world_size"], f"step {step}: not every rank trained it"
        pairs = sum(len(r["ids"]) for r in trained["ranks"])
        last_of_epoch = (step + 1) % STEPS_PER_EPOCH == 0
        assert pairs == GLOBAL_BATCH or last_of_epoch, f"step {step} trained {pairs} pairs"


def test_every_pair_is_trained_once_per_epoch_across_the_changes_of_world_size(run):
    _, steps = run["training"]
    for epoch in range(EPOCHS):
        counts = Counter(i for t in steps.values() if t["epoch"] == epoch for r in t["ranks"] for i in r["ids"])
        assert max(counts.values()) == 1, f"epoch {epoch}: a pair trained twice"
        assert NUM_TRAIN - len(counts) < GLOBAL_BATCH, f"epoch {epoch}: more than the tail left out"
    changes = [s for s in sorted(steps) if s and steps[s]["world_size"] != steps[s - 1]["world_size"]]
    assert len(changes) == run["changes"], changes
    assert all(STEPS_PER_EPOCH < s < 2 * STEPS_PER_EPOCH for s in changes), f"not mid-epoch: {changes}"
