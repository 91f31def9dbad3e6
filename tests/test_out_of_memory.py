"""A step that does not fit in memory: one paragraph naming the process, what it asked for and the settings that
make it fit, exit 1, no traceback. tests.zoo.AttentionRegressor's scores take memory in the square of the sequence
length: at 400,000 steps, far more than any machine has."""

import re

import pytest
import torch

from tests.helpers.one_node import ended, last_paragraph, start, traces
from training.run.out_of_memory import out_of_memory

TOO_LONG = ["--model=tests.zoo.AttentionRegressor", "--data=tests.zoo.Sequences", "--data.init_args.seq_len=400000"]
ADVICE = (
    "Lower the batch size (the data module's batch_size, e.g. --data.init_args.batch_size) or the size of a sample (a "
    "sequence length, an image size), or train in a lower precision (--trainer.precision=bf16-mixed); "
)


def test_the_cpu_and_gpu_allocators_refusals_name_the_size_and_where_to_make_room():
    with pytest.raises(RuntimeError) as cpu:
        torch.empty(2**40, dtype=torch.uint8)  # 1 TiB
    assert out_of_memory(cpu.value, "rank 1", "train") == (
        f"rank 1 ran out of memory in a training step: it asked for 1,024.0 GiB, which did not fit. {ADVICE}the "
        "processes of a machine share its memory: fewer of them (--trainer.devices) leave each more. Then run the "
        "same command: it resumes from the run's last.ckpt, if it has one."
    )
    gpu = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of ...")
    assert out_of_memory(gpu, stage="validate").startswith(
        "this process ran out of GPU memory in a validation step: it asked for 20.00 GiB, which did not fit. "
    )
    assert "FSDP (configs/fsdp.yaml) shards the model's weights" in out_of_memory(gpu)
    assert out_of_memory(RuntimeError("shapes do not match")) is None


@pytest.mark.distributed
def test_a_training_step_too_big_for_memory_stops_the_job_with_one_paragraph_naming_the_process(tmp_path):
    result = ended(tmp_path, start(tmp_path, *TOO_LONG))
    assert result["status"] == 1, result["output"]
    assert not traces(result["output"]), result["output"]
    paragraph = last_paragraph(result["output"])
    assert re.match(
        r"error: rank [01] \(local rank [01], pid \d+\) of node 0 \([^)]+\) ran out of memory in a training step: it "
        r"asked for [\d,.]+ GiB, which did not fit\. ",
        paragraph,
    ), paragraph
    assert ADVICE in paragraph
    assert result["output"].count("error: ") == 1
    assert result["left"] == [], "processes of the job left running"
