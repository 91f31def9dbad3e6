"""A learning-rate scheduler sized by the run's total steps (OneCycleLR), which a longer resumed run outruns."""

import re

from lightning.pytorch import Trainer

# What OneCycleLR raises when stepped past the steps it was sized for.
OUTRUN = re.compile(r"Tried to step (\d+) times\. The specified number of total steps is (\d+)")
NEW_RUN = (
    "A resumed run keeps the scheduler's size, so raising trainer.max_epochs or trainer.max_steps cannot lengthen its "
    "schedule. To train longer with a schedule of the new length, set RUN_ID to start a new run"
)


def sized_schedule_note(trainer: Trainer) -> str:
    """For the paragraph of a run at its end: a warning for each scheduler that has taken every step it was sized
    for (``total_steps``), which stops the run at its next step if the run is made longer; "" if none has."""
    ended = [
        f"{type(config.scheduler).__name__} ({config.scheduler.total_steps} steps)"
        for config in trainer.lr_scheduler_configs
        if getattr(config.scheduler, "total_steps", None) is not None
        and config.scheduler.last_epoch >= config.scheduler.total_steps
    ]
    if not ended:
        return ""
    return (
        f" But its learning-rate scheduler {', '.join(ended)} has taken every step it was sized for: raised, those "
        f"limits would stop the run at its next step. {NEW_RUN}."
    )


def schedule_outrun(error: BaseException) -> str | None:
    """The paragraph for a scheduler stepped past the steps it was sized for (OneCycleLR's ValueError), or None."""
    found = OUTRUN.search(str(error)) if isinstance(error, ValueError) else None
    if found is None:
        return None
    return (
        f"the learning-rate scheduler was sized for {found[2]} steps, and the run asked it for step {found[1]}: a "
        "scheduler sized by the run's total steps (OneCycleLR's total_steps, from trainer.estimated_stepping_batches) "
        f"gets them once, when the run starts. {NEW_RUN}, or lower trainer.max_epochs or trainer.max_steps back to "
        "where this run ended. Training stopped at that step; the run's last.ckpt is as it was."
    )
