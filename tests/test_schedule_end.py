"""A finished run whose OneCycleLR was sized by its total steps (tests.zoo.OneCycleClassifier), on 2 CPU processes:
the "Nothing to train" paragraph warns that raising max_epochs would outrun the scheduler, and a run made longer
anyway stops with one paragraph instead of OneCycleLR's ValueError traceback from every process."""

import pytest

from tests.helpers.one_node import ended, last_paragraph, start, traces

pytestmark = pytest.mark.distributed

RUN = ["--model=tests.zoo.OneCycleClassifier", "--data=tests.zoo.Blobs", "--monitor=val_loss", "--trainer.max_epochs=2"]
STEPS = 8  # tests.zoo.Blobs: 4 batches per epoch on 2 processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("onecycle")
    finished = ended(workdir, start(workdir, *RUN), within=600)
    again = ended(workdir, start(workdir, *RUN), within=600)
    longer = ended(workdir, start(workdir, *RUN, "--trainer.max_epochs=3"), within=600)
    return finished, again, longer


def test_nothing_to_train_warns_that_the_scheduler_would_not_survive_a_longer_run(runs):
    finished, again, _ = runs
    assert finished["status"] == again["status"] == 0, finished["output"] + again["output"]
    (note,) = [line for line in again["output"].splitlines() if line.startswith("Nothing to train")]
    assert note.endswith(
        f"set RUN_ID to start a new run. But its learning-rate scheduler OneCycleLR ({STEPS} steps) has taken every "
        "step it was sized for: raised, those limits would stop the run at its next step. A resumed run keeps the "
        "scheduler's size, so raising trainer.max_epochs or trainer.max_steps cannot lengthen its schedule. To train "
        "longer with a schedule of the new length, set RUN_ID to start a new run."
    ), note


def test_a_run_made_longer_anyway_stops_with_one_paragraph(runs):
    _, _, longer = runs
    assert longer["status"] == 1, longer["output"]
    assert not traces(longer["output"]), longer["output"]
    assert last_paragraph(longer["output"]) == (
        f"error: the learning-rate scheduler was sized for {STEPS} steps, and the run asked it for step {STEPS + 1}: a "
        "scheduler sized by the run's total steps (OneCycleLR's total_steps, from trainer.estimated_stepping_batches) "
        "gets them once, when the run starts. A resumed run keeps the scheduler's size, so raising "
        "trainer.max_epochs or trainer.max_steps cannot lengthen its schedule. To train longer with a schedule of the "
        "new length, set RUN_ID to start a new run, or lower trainer.max_epochs or trainer.max_steps back to where "
        "this run ended. Training stopped at that step; the run's last.ckpt is as it was."
    )
    assert longer["output"].count("error: ") == 1
