"""training/job/elastic.py in-process: the global batch kept at every size of a job, and the node count torchrun
gives."""

from types import SimpleNamespace

import pytest
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.environments import LightningEnvironment, TorchElasticEnvironment
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from training.job.elastic import GlobalBatch, nodes_present


class Model(LightningModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size


def trainer(world_size: int, min_nodes: int | None = 2, most: int = 3, accumulate: int = 1) -> SimpleNamespace:
    strategy = SimpleNamespace(min_nodes=min_nodes, configured_nodes=most)
    return SimpleNamespace(
        strategy=strategy,
        num_nodes=world_size // 2,
        num_devices=2,
        world_size=world_size,
        accumulate_grad_batches=accumulate,
    )


def test_the_batch_size_or_the_accumulation_takes_up_what_the_processes_do_not():
    model, running = Model(batch_size=99), trainer(world_size=4)
    GlobalBatch(24).setup(running, model, "fit")
    assert model.batch_size == 6
    model, running = Model(batch_size=2), trainer(world_size=6)
    GlobalBatch(24, adapt="accumulate").setup(running, model, "fit")
    assert (model.batch_size, running.accumulate_grad_batches) == (2, 2)


def test_a_size_a_node_count_of_the_job_cannot_keep_stops_it_at_once():
    # Batches of 3: 2 nodes of 2 processes keep 24 with 2 accumulated batches, 3 nodes (18 a round) do not.
    with pytest.raises(MisconfigurationException, match=r"a global batch of 24 cannot be kept on 3 node\(s\) of 2"):
        GlobalBatch(24, adapt="accumulate").setup(trainer(world_size=4), Model(batch_size=3), "fit")
    with pytest.raises(
        MisconfigurationException, match=r"cannot be kept on 2, 3 node\(s\) .*accumulate_grad_batches 5"
    ):
        GlobalBatch(24).setup(trainer(world_size=4, accumulate=5), Model(batch_size=4), "fit")


def test_torchrun_gives_the_node_count_within_the_range(monkeypatch):
    for name, value in {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "ddp")
    assert nodes_present(2, 3, TorchElasticEnvironment(), processes=2) == 2
    assert nodes_present(None, 3, TorchElasticEnvironment(), processes=2) == 3, "not elastic: the config's count"
    with pytest.raises(
        MisconfigurationException, match="torchrun started 4 processes, which is not 1 per node on 2 to 3"
    ):
        nodes_present(2, 3, TorchElasticEnvironment(), processes=1)
    with pytest.raises(MisconfigurationException, match="min_nodes=4 must be between 1 and trainer.num_nodes=3"):
        nodes_present(4, 3, TorchElasticEnvironment(), processes=2)
    with pytest.warns(UserWarning, match="elastic under torchrun only"):
        assert nodes_present(2, 3, LightningEnvironment(), processes=2) == 3
