"""training.StepTime: where each step's time goes on every node, the slow node named, the scaling summary.

The two-host jobs share one run per case: node 1's data loader slowed (tests.helpers.probe.SlowLoader), and the
same job with nothing slowed, whose nodes differ by what a machine busy with other work makes of them.
"""

import json
import re
import statistics
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import DDP_YAML, REPO, SINGLE_PROCESS, copy_project, finish, launch, needs_gpus, run_script
from training.step_time.callback import StepTime, samples_in
from training.step_time.clocks import CpuClock, GradientsReady, Step
from training.step_time.figures import Node, SlowNodeWatch, paragraph, per_node, summary

PACE = 0.1  # seconds the slowed loaders sleep before each batch
BATCHES, LOG_EVERY, WINDOW = 48, 3, 24
SLOW_NODE = re.compile(r"node (\d) \(([^,]+), ([\d.]+)\) is the slow node: .*?(?=\n|$)")
FIGURES = re.compile(
    r"it spent ([\d.]+) ms per step (waiting for data|computing)\b.*?the other nodes' ([\d.]+) ms .*? the other "
    r"nodes spent ([\d.]+) ms of their ([\d.]+) ms steps"
)
STEP_SHARE = re.compile(r"trained ([\d,.]+) samples/s, ([\d,.]+) per process; of a ([\d.]+) ms step")


def two_host_job(tmp_path_factory, hosts: list[dict], slowed: str, port: str) -> dict:
    """One process on each host, trained for BATCHES batches; the nodes in ``slowed`` wait PACE per batch. Each
    node's own copy of configs/ddp.yaml shortens StepTime's window, as a user would edit it; its thresholds stay."""
    root = tmp_path_factory.mktemp("step_time")
    nodes = [copy_project(root / f"node{rank}") for rank in range(2)]
    for node in nodes:
        config = node / "configs" / "ddp.yaml"
        config.write_text(config.read_text().replace("window: 100", f"window: {WINDOW}"))
    args = [
        "--trainer.max_epochs=1",
        f"--trainer.limit_train_batches={BATCHES}",
        "--trainer.limit_val_batches=0",
        f"--trainer.log_every_n_steps={LOG_EVERY}",
        "--trainer.callbacks+=tests.helpers.probe.SlowLoader",
        f"--trainer.callbacks.seconds={PACE}",
        f"--trainer.callbacks.nodes={slowed}",
        # An independent clock of the steps: when each started, on global rank 0.
        "--trainer.callbacks+=benchmarks.timing.StepTimer",
        f"--trainer.callbacks.out={root / 'starts.json'}",
    ]
    settings = {"MASTER_ADDR": hosts[0]["address"], "MASTER_PORT": port, "NUM_NODES": "2"}
    # One thread each: two threads of a process on a loaded machine wait for each other at every operation.
    settings["OMP_NUM_THREADS"] = "1"
    worker = launch(nodes[1], "cpu:1", 1, *args, netns=hosts[1]["netns"], **settings)
    master = launch(nodes[0], "cpu:1", 0, *args, netns=hosts[0]["netns"], **settings)
    return {
        "outputs": [finish(master), finish(worker)],
        "run": nodes[0] / "logs" / "toy" / "default",
        "starts": json.loads((root / "starts.json").read_text())["starts"],
    }


@pytest.fixture(scope="module")
def slow_node_job(tmp_path_factory, two_hosts_for_module):
    return two_host_job(tmp_path_factory, two_hosts_for_module, "[1]", "29500")


@pytest.fixture(scope="module")
def unslowed_job(tmp_path_factory, two_hosts_for_module):
    return two_host_job(tmp_path_factory, two_hosts_for_module, "[]", "29501")


def timing_scalars(run) -> dict[str, list[float]]:
    events = EventAccumulator(str(run))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"] if "timing/" in tag}


@pytest.mark.distributed
def test_every_node_names_the_slow_node_once_with_the_part_of_the_step(slow_node_job, two_hosts_for_module):
    for output in slow_node_job["outputs"]:
        named = SLOW_NODE.findall(output)
        assert len(named) == 1, output  # once for the episode, not at every log interval after it
        node, _, address = named[0]
        assert (node, address) == ("1", two_hosts_for_module[1]["address"]), named
        found = SLOW_NODE.search(output).group(0)
        mine, part, others, waiting, others_step = FIGURES.search(found).groups()
        assert part == "waiting for data" and "loader workers" in found
        # A slowed batch waits at least PACE; the other node waits for it in the allreduce for most of that.
        assert float(mine) >= 1e3 * PACE > 5 * float(others)
        assert float(waiting) > 0.5 * float(mine) and float(others_step) >= float(mine)


@pytest.mark.distributed
def test_the_parts_add_up_to_the_step_time_an_independent_clock_measured(slow_node_job):
    output = slow_node_job["outputs"][0]
    step_ms = float(STEP_SHARE.search(output).group(3).replace(",", ""))
    # StepTimer's starts, on global rank 0: the steps StepTime measured are all but the first of the epoch.
    starts = slow_node_job["starts"][1:]
    independent = 1e3 * statistics.fmean(b - a for a, b in zip(starts, starts[1:], strict=False))
    assert step_ms == pytest.approx(independent, rel=0.1)  # within 10%
    # Logged per node: the parts of each log interval add up to its step, within rounding (1e-6 relative).
    scalars = timing_scalars(slow_node_job["run"])
    for node in (0, 1):
        parts = [scalars[f"timing/node{node}/{part}_ms"] for part in ("data", "compute", "collective")]
        sums = [sum(values) for values in zip(*parts, strict=True)]
        assert sums == pytest.approx(scalars[f"timing/node{node}/step_ms"], rel=1e-6)
        assert len(sums) == BATCHES // LOG_EVERY
    data = scalars["timing/node1/data_ms"][-1], scalars["timing/node0/data_ms"][-1]
    assert data[0] >= 1e3 * PACE > data[1]
    samples_per_s = scalars["timing/samples_per_s"][-1]
    assert samples_per_s == pytest.approx(2 * 64 / (scalars["timing/node0/step_ms"][-1] / 1e3), rel=0.1)


@pytest.mark.distributed
def test_every_node_ends_with_a_scaling_summary(slow_node_job):
    for output in slow_node_job["outputs"]:
        job, per_process, step_ms = (float(v.replace(",", "")) for v in STEP_SHARE.search(output).groups())
        assert "Scaling summary: 2 processes on 2 nodes trained" in output
        assert job == pytest.approx(2 * per_process, rel=0.1)
        assert per_process == pytest.approx(64 / (step_ms / 1e3), rel=0.1)
        assert re.search(r"node 1 \([^)]*\): ([\d.]+) ms data", output)


@pytest.mark.distributed
def test_the_same_job_with_nothing_slowed_names_no_slow_node(unslowed_job):
    for output in unslowed_job["outputs"]:
        assert "is the slow node" not in output
        assert "Scaling summary: 2 processes on 2 nodes" in output
    # Every node's figures of every interval reached the watch: it judged every full window of the run.
    scalars = timing_scalars(unslowed_job["run"])
    assert [len(scalars[f"timing/node{node}/step_ms"]) for node in (0, 1)] == [BATCHES // LOG_EVERY] * 2


def test_the_parts_of_a_step_add_up_to_its_time_and_the_wait_is_clipped_to_it():
    clock = CpuClock()
    step = Step(previous_end=10.0, start=10.05, end=10.25, handed=10.1, done=10.22, samples=64)
    parts = step.parts(clock)
    assert parts == pytest.approx({"data": 50.0, "compute": 80.0, "collective": 120.0})
    assert sum(parts.values()) == pytest.approx(clock.ms(10.0, 10.25))
    # A stamp of the allreduce's return after the step's end (another thread's clock) counts no more than the step.
    late = Step(previous_end=0.0, start=0.0, end=0.1, handed=0.05, done=0.3, samples=64).parts(clock)
    assert late == pytest.approx({"data": 0.0, "compute": 0.0, "collective": 100.0})
    alone = Step(previous_end=0.0, start=0.01, end=0.03, handed=None, done=None, samples=8).parts(clock)
    assert alone == pytest.approx({"data": 10.0, "compute": 20.0, "collective": 0.0})


def test_the_last_gradient_computed_is_stamped_by_one_hook_after_the_first_step(process_group_alone):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    inputs = torch.randn(4, 8)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ready = GradientsReady(CpuClock(), list(model.parameters()))
    assert len(ready.hooks) == 4
    stamps = []
    for _ in range(2):
        ddp(inputs).sum().backward()
        stamps.append(ready.take())
        # The backward pass ends with the first layer's gradients, the last ones computed; only that hook stays.
        assert ready.last in (0, 1) and list(ready.hooks) == [ready.last]
    assert all(stamp is not None for stamp in stamps) and stamps[1] > stamps[0] and ready.take() is None


@pytest.mark.parametrize(
    ("batch", "samples"),
    [
        ((torch.zeros(7, 3), torch.zeros(7)), 7),
        (torch.zeros(5, 2), 5),
        ({"source": torch.zeros(4, 9), "target": torch.zeros(4, 3)}, 4),
        (["no", "tensor"], 0),
    ],
)
def test_a_steps_samples_are_the_length_of_its_batchs_first_tensor(batch, samples):
    assert samples_in(batch) == samples


def test_per_node_figures_are_the_mean_of_their_processes():
    # steps, samples, data, compute, collective (ms summed over the steps), steps left out
    rows = [[2, 128, 2.0, 20.0, 4.0, 0], [2, 128, 6.0, 24.0, 0.0, 1], [4, 256, 400.0, 40.0, 0.0, 0], [0] * 6]
    figures = per_node(rows, [0, 0, 1, 2])
    assert list(figures) == [0, 1]  # node 2 measured no step
    assert figures[0] == pytest.approx(
        {"data": 2.0, "compute": 11.0, "collective": 1.0, "step": 14.0, "steps": 4, "samples": 256}
    )
    assert figures[1]["data"] == 100.0 and figures[1]["step"] == 110.0


def figures(slow: dict[str, float], fast: dict[str, float]) -> dict[int, dict[str, float]]:
    def node(parts: dict[str, float]) -> dict[str, float]:
        full = {"data": 1.0, "compute": 10.0, "collective": 0.0, **parts}
        return {**full, "step": full["data"] + full["compute"] + full["collective"]}

    return {0: node(fast), 1: node(slow)}


def test_a_slow_node_is_named_once_per_episode_after_a_whole_window():
    watch = SlowNodeWatch(window=6, slower_by=1.5, min_share=0.2, min_ms=10)
    slow = figures({"data": 50.0}, {"collective": 49.0})
    assert [watch.add(2, slow) for _ in range(2)] == [None, None]  # 4 steps: the window is not full yet
    finding = watch.add(2, slow)
    assert (finding.node, finding.part, finding.mine, finding.others, finding.waiting) == (1, "data", 50, 1, 49)
    assert [watch.add(2, slow) for _ in range(5)] == [None] * 5  # the same episode
    # A window back at the same pace ends the episode.
    even = figures({}, {})
    assert [watch.add(2, even) for _ in range(3)] == [None] * 3 and watch.reported is None
    assert watch.add(2, slow) is None  # one slow interval (a checkpoint save, a busy second) moves no median
    assert watch.add(2, slow).node == 1  # most of the window: a new episode


def test_compute_slowness_is_named_with_what_the_others_wait():
    watch = SlowNodeWatch(window=2, slower_by=1.5, min_share=0.2, min_ms=10)
    finding = watch.add(2, figures({"compute": 30.0}, {"collective": 20.0}))
    assert (finding.node, finding.part, finding.waiting, finding.others_step) == (1, "compute", 20.0, 31.0)
    text = paragraph(finding, {0: Node(0, "a", "10.0.0.1"), 1: Node(1, "gpu-b", "10.0.0.2")})
    assert text.startswith("node 1 (gpu-b, 10.0.0.2) is the slow node: over the last 2 steps it spent 30.0 ms")
    assert "computing (forward, backward, optimizer), 3.0 times the other nodes' 10.0 ms (+20.0 ms)" in text
    assert "spent 20.0 ms of their 31.0 ms steps (65%) waiting for it" in text and "throttled" in text


@pytest.mark.parametrize(
    ("slow", "why"),
    [
        ({"compute": 14.0}, "1.4 times the others' compute: below slower_by"),
        ({"data": 3.5}, "3.5 times the others' data, but 2.5 ms of a 13.5 ms step: below min_share"),
        ({"data": 9.0}, "9 times the others' data and 8 ms of a 19 ms step (over min_share), but below min_ms"),
        ({}, "the same pace"),
    ],
)
def test_nodes_within_the_thresholds_name_nobody(slow, why):
    watch = SlowNodeWatch(window=2, slower_by=1.5, min_share=0.2, min_ms=10)
    assert watch.add(2, figures(slow, {})) is None, why


def test_one_node_alone_has_nobody_to_be_slower_than():
    watch = SlowNodeWatch(window=1, slower_by=1.5, min_share=0.2, min_ms=10)
    assert watch.add(1, {0: {"data": 90.0, "compute": 1.0, "collective": 0.0, "step": 91.0}}) is None


def test_the_summary_gives_the_job_and_process_rates_and_the_shares_of_a_step():
    # Each process: 10 steps of 64 samples, 100 ms each (10 data, 60 compute, 30 collective).
    rows = [[10, 640, 100.0, 600.0, 300.0, 0], [10, 640, 100.0, 600.0, 300.0, 0]]
    text = summary(rows, [0, 1], {0: Node(0, "a", "10.0.0.1"), 1: Node(1, "b", "10.0.0.2")}, True)
    assert text.splitlines() == [
        "Scaling summary: 2 processes on 2 nodes trained 1,280.0 samples/s, 640.0 per process; of a 100.0 ms step, "
        "10% went to waiting for data, 30% to waiting in collectives and 60% to computing. Without those waits the "
        "job would train 2,133.3 samples/s.",
        "  node 0 (a, 10.0.0.1): 10.0 ms data, 60.0 ms compute, 30.0 ms collectives per step",
        "  node 1 (b, 10.0.0.2): 10.0 ms data, 60.0 ms compute, 30.0 ms collectives per step",
    ]


def test_steps_that_compile_or_warm_up_are_left_out_of_every_figure_and_the_summary_says_how_many():
    # Steps of 1 ms data and 4 ms computation (CPU clock stamps, in seconds), but for two that compile: the second
    # (the backward pass compiling) and one at a new shape (a short last batch), 80 and 400 times that.
    computes = [4, 320, 4, 4, 4, 4, 1600, 4, 4]
    callback, now = StepTime(), 0.0
    for compute in computes:
        callback.pending.append(Step(now, now + 0.001, now + 0.001 + compute / 1e3, None, None, 64))
        now += 0.001 + compute / 1e3
    callback.settle(wait=True)
    assert callback.total == pytest.approx([7, 7 * 64, 7.0, 28.0, 0.0, 2])
    rows = [callback.total]
    text = summary(rows, [0], {0: Node(0, "a", "10.0.0.1")}, True)
    assert "of a 5.0 ms step, 20% went to waiting for data" in text
    assert text.splitlines()[0].endswith(
        "Left out: 2 steps whose computation took over 10 times the median step's (compilation by torch.compile, "
        "warm-up)."
    )


def test_one_process_logs_its_figures_beside_the_training_loss_and_ends_with_a_summary(run_cli, tmp_path, capsys):
    train = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=9", "--trainer.limit_val_batches=0"]
    run_cli("fit", "-c", DDP_YAML, *SINGLE_PROCESS, *train, "--trainer.log_every_n_steps=3")
    events = EventAccumulator(str(tmp_path / "logs" / "toy" / "default"))
    events.Reload()
    steps = {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    # Written with the step's own metrics: the first log interval measured its steps after the first.
    assert steps["train/loss"] == [2, 5, 8]
    for part in ("data", "compute", "collective", "step"):
        assert steps[f"timing/node0/{part}_ms"] == [2, 5, 8]
    assert steps["timing/samples_per_s"] == [2, 5, 8]
    err = capsys.readouterr().err
    assert "Scaling summary: 1 process on 1 node trained " in err
    assert "(collective waits included, not measured apart without DDP)" in err and "is the slow node" not in err


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("--trainer.callbacks.window=0", "training.StepTime's window must be at least 1 step, got 0: set it in"),
        ("--trainer.callbacks.slower_by=0.5", "training.StepTime's slower_by must be at least 1, got 0.5: set it in"),
        ("--trainer.callbacks.min_share=1", "training.StepTime's min_share must be from 0 to below 1, got 1.0: set"),
        ("--trainer.callbacks.min_ms=-1", "training.StepTime's min_ms must be 0 or more, got -1.0: set it in"),
    ],
)
def test_settings_out_of_range_are_refused_naming_them(setting, message, run_cli, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_cli("fit", "-c", DDP_YAML, *SINGLE_PROCESS, "--trainer.callbacks+=training.StepTime", setting)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err


@pytest.mark.distributed
@needs_gpus(1)
def test_on_one_gpu_the_steps_are_timed_by_cuda_events_without_a_synchronize(tmp_path):
    out = tmp_path / "sync.json"
    args = [
        str(REPO / "cli.py"),
        "fit",
        "-c",
        DDP_YAML,
        "--trainer.accelerator=gpu",
        "--trainer.devices=1",
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=40",
        "--trainer.limit_val_batches=0",
        "--trainer.log_every_n_steps=5",
        "--trainer.callbacks+=tests.helpers.probe.CudaSyncCount",
        f"--trainer.callbacks.out={out}",
    ]
    result = run_script([sys.executable, *args], cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert json.loads(out.read_text()) == {"synchronize_calls": 0, "clocks": ["CudaClock"]}
    assert "Scaling summary: 1 process on 1 node trained" in output
    scalars = timing_scalars(tmp_path / "logs" / "toy" / "default")
    parts = [scalars[f"timing/node0/{part}_ms"] for part in ("data", "compute", "collective")]
    assert [sum(p) for p in zip(*parts, strict=True)] == pytest.approx(scalars["timing/node0/step_ms"], rel=1e-6)
    assert all(value > 0 for value in scalars["timing/node0/step_ms"])
