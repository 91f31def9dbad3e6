"""The seq2seq DataModule: reading pairs, bad input, the vocabulary, padding, batching, the built-in corpus."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.environments import LightningEnvironment, SLURMEnvironment
from torch.utils.data import DistributedSampler

from data import Seq2SeqDataModule
from data.length_sampler import LengthGroupedBatchSampler
from data.number_corpus import builtin_pairs, number_to_words
from data.seq2seq_batches import BOS, EOS, PAD, UNK, collate
from tests.helpers import DDP_YAML, REPO

SEQ2SEQ_YAML = str(REPO / "configs" / "seq2seq.yaml")


def write(path, lines: list[str]):
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def test_number_to_words_gives_the_english_names():
    examples = {
        0: "zero",
        7: "seven",
        14: "fourteen",
        40: "forty",
        99: "ninety-nine",
        100: "one hundred",
        305: "three hundred five",
        1000: "one thousand",
        20020: "twenty thousand twenty",
        305017: "three hundred five thousand seventeen",
        999999: "nine hundred ninety-nine thousand nine hundred ninety-nine",
    }
    assert {n: number_to_words(n) for n in examples} == examples


def test_builtin_corpus_is_seeded_distinct_and_spans_every_length():
    pairs = builtin_pairs(3000, max_digits=6, seed=1)
    assert pairs == builtin_pairs(3000, max_digits=6, seed=1)
    assert pairs != builtin_pairs(3000, max_digits=6, seed=2)
    numbers = [int(s.replace(",", "")) for s, _ in pairs]
    assert all(s == f"{n:,}" and t == number_to_words(n) for n, (s, t) in zip(numbers, pairs, strict=True))
    assert len(set(numbers)) == 3000
    assert {len(str(n)) for n in numbers} == {1, 2, 3, 4, 5, 6}
    assert sum(n >= 1000 and n % 1000 == 0 for n in numbers) > 0.02 * len(pairs)  # round thousands come up


def test_prepare_data_writes_the_corpus_once_and_atomically(tmp_path):
    data = Seq2SeqDataModule(data_dir=str(tmp_path / "cache"), num_pairs=100, max_digits=3)
    data.prepare_data()
    written = data.corpus_path.stat().st_mtime_ns
    data.prepare_data()
    assert data.corpus_path.stat().st_mtime_ns == written
    assert [p.name for p in data.corpus_path.parent.iterdir()] == [data.corpus_path.name]  # no temporary file left
    assert len(data.corpus_path.read_text().splitlines()) == 100
    (tmp_path / "mine").touch()
    assert data.corpus_path.stat().st_mode == (tmp_path / "mine").stat().st_mode, "not the umask's permissions"


def test_builtin_vocabulary_covers_its_corpus_without_unknown_tokens(tmp_path):
    data = Seq2SeqDataModule(data_dir=str(tmp_path), num_pairs=3000)
    data.prepare_data()
    data.setup("fit")
    pairs = data.splits["train"] + data.splits["val"]
    assert all(UNK not in ids for ids in data.encode([text for pair in pairs for text in pair]))


def test_tsv_and_jsonl_give_the_same_pairs_and_vocabulary(tmp_path):
    pairs = [("héllo wörld", "HELLO"), ("a b", "x:y"), ("42", "forty-two")]
    tsv = write(tmp_path / "pairs.tsv", [f"{s}\t{t}" for s, t in pairs])
    jsonl = write(tmp_path / "pairs.jsonl", [json.dumps({"target": t, "source": s}) for s, t in pairs])
    from_tsv, from_jsonl = Seq2SeqDataModule(path=str(tsv)), Seq2SeqDataModule(path=str(jsonl))
    assert from_tsv.pairs == from_jsonl.pairs == pairs
    assert from_tsv.vocab == from_jsonl.vocab
    assert from_tsv.vocab_size == 4 + len(set("héllo wörldHELLOa bx:y42forty-two"))


def test_vocabulary_is_sorted_so_line_order_does_not_matter(tmp_path):
    lines = ["cab\tzy", "b\tx", "a\ta b"]
    first = Seq2SeqDataModule(path=str(write(tmp_path / "a.tsv", lines)))
    shuffled = Seq2SeqDataModule(path=str(write(tmp_path / "b.tsv", lines[::-1])))
    assert first.vocab == shuffled.vocab == ["<pad>", "<s>", "</s>", "<unk>", " ", "a", "b", "c", "x", "y", "z"]


def test_windows_line_endings_and_a_byte_order_mark_are_not_part_of_the_text(tmp_path):
    path = tmp_path / "win.tsv"
    path.write_bytes(b"\xef\xbb\xbfab\tcd\r\nef\tgh\r\n")
    assert Seq2SeqDataModule(path=str(path)).pairs == [("ab", "cd"), ("ef", "gh")]


BAD_TSV = {
    "no tab": (["a\tb", "just text", "c\td"], "bad.tsv:2: no tab"),
    "empty target": (["a\tb", "c\td", "e\t"], "bad.tsv:3: empty target"),
    "empty source": (["\tb"], "bad.tsv:1: empty source"),
    "two tabs": (["a\tb\tc"], "bad.tsv:1: 2 tabs, expected one"),
    "blank line": (["a\tb", "", "c\td"], "bad.tsv:2: empty line"),
}


@pytest.mark.parametrize("case", BAD_TSV)
def test_a_malformed_tsv_line_is_named_with_its_number(tmp_path, case):
    lines, expected = BAD_TSV[case]
    with pytest.raises(ValueError) as error:
        Seq2SeqDataModule(path=str(write(tmp_path / "bad.tsv", lines)))
    assert f"data.path: {tmp_path / expected}" in str(error.value)
    assert "each line must be source<TAB>target" in str(error.value)


BAD_JSONL = {
    "unknown field": ('{"source": "a", "target": "b", "lang": "en"}', "unknown field 'lang'"),
    "missing field": ('{"source": "a"}', "missing field 'target'"),
    "not JSON": ('{"source": "a", "target": }', "not valid JSON"),
    "not an object": ('["a", "b"]', "not a JSON object"),
    "not a string": ('{"source": "a", "target": 3}', "source and target must be strings"),
    "empty target": ('{"source": "a", "target": ""}', "empty target"),
    "tab in text": ('{"source": "a\\tb", "target": "c"}', "the source contains a tab"),
}


@pytest.mark.parametrize("case", BAD_JSONL)
def test_a_malformed_jsonl_line_is_named_with_its_number(tmp_path, case):
    line, problem = BAD_JSONL[case]
    path = write(tmp_path / "bad.jsonl", ['{"source": "x", "target": "y"}', line])
    with pytest.raises(ValueError) as error:
        Seq2SeqDataModule(path=str(path))
    assert f"data.path: {path}:2: {problem}" in str(error.value)


def test_empty_missing_undecodable_and_unknown_format_files_are_refused(tmp_path):
    (tmp_path / "empty.tsv").write_text("\n")
    (tmp_path / "latin1.tsv").write_bytes("a\tb\ncaf\xe9\tc\n".encode("latin-1"))
    (tmp_path / "pairs.csv").write_text("a,b\n")
    expected = {
        "empty.tsv": "empty.tsv is empty",
        "missing.tsv": "no such file",
        "latin1.tsv": "latin1.tsv:2: not valid UTF-8",
        "pairs.csv": "unknown format",
    }
    for name, message in expected.items():
        with pytest.raises(ValueError, match="^data.path: ") as error:
            Seq2SeqDataModule(path=str(tmp_path / name))
        assert message in str(error.value), name


def test_a_builtin_corpus_larger_than_half_its_numbers_is_refused():
    with pytest.raises(ValueError, match="data.num_pairs=600 is more than half of the 1000 numbers"):
        Seq2SeqDataModule(num_pairs=600, max_digits=3)


def test_bad_predict_file_is_named(tmp_path):
    path = write(tmp_path / "sources.txt", ["12", "", "7"])
    with pytest.raises(ValueError) as error:
        Seq2SeqDataModule(predict_path=str(path))
    assert f"data.predict_path: {path}:2: empty source; give one source per line" in str(error.value)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("val_fraction", 0.0, "data.val_fraction must be between 0 and 1"),
        ("val_fraction", 0.9, "data.val_fraction=0.9 of 3 distinct sources leaves 0 to train on"),
        ("batch_size", 0, "data.batch_size must be a positive integer"),
        ("max_digits", 7, "data.max_digits must be between 1 and 6"),
    ],
)
def test_impossible_settings_name_the_flag(tmp_path, flag, value, message):
    path = write(tmp_path / "pairs.tsv", ["a\tx", "b\ty", "c\tz", "a\tw"])
    with pytest.raises(ValueError, match=message):
        Seq2SeqDataModule(path=str(path), **{flag: value})


def test_bad_data_stops_the_cli_before_training_with_one_clear_line(run_cli, capsys, tmp_path):
    bad = write(tmp_path / "pairs.tsv", ["1\tone", "2\ttwo", "3 three"])
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", "-c", DDP_YAML, "-c", SEQ2SEQ_YAML, f"--data.init_args.path={bad}")
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert f"error: data.path: {bad}:3: no tab; each line must be source<TAB>target" in err
    assert not (tmp_path / "logs").exists()


def test_collate_pads_each_batch_to_its_longest_sequence_and_masks_the_padding():
    items = [(4, [5, 6], [BOS, 7, EOS]), (9, [5, 6, 7, 8], [BOS, EOS]), (2, [8], [BOS, 9, 9, 9, EOS])]
    batch = collate(items)
    assert batch["index"].tolist() == [4, 9, 2]
    assert batch["source"].tolist() == [[5, 6, PAD, PAD], [5, 6, 7, 8], [8, PAD, PAD, PAD]]
    assert batch["source_padding_mask"].tolist() == [[False, False, True, True], [False] * 4, [False, True, True, True]]
    assert batch["target"].tolist() == [[BOS, 7, EOS, PAD, PAD], [BOS, EOS, PAD, PAD, PAD], [BOS, 9, 9, 9, EOS]]
    assert batch["target_padding_mask"].tolist() == [[False] * 3 + [True] * 2, [False] * 2 + [True] * 3, [False] * 5]
    assert batch["source_padding_mask"].dtype == torch.bool

    shorter = collate(items[:1])
    assert shorter["source"].shape == (1, 2) and shorter["target"].shape == (1, 3)
    assert collate([(0, [5], None)]).keys() == {"index", "source", "source_padding_mask"}


def test_unknown_characters_become_the_unknown_token(tmp_path):
    data = Seq2SeqDataModule(data_dir=str(tmp_path))
    ids = data.encode(["1€2"])[0]
    assert ids[1] == UNK and UNK not in (ids[0], ids[2])
    assert data.decode([data.vocab.index("4"), UNK, EOS, data.vocab.index("5")]) == "4<unk>"


def test_checkpoint_vocabulary_replaces_the_rebuilt_one(tmp_path):
    trained = Seq2SeqDataModule(path=str(write(tmp_path / "a.tsv", ["ab\tcd", "a\tc"])))
    rebuilt = Seq2SeqDataModule(path=str(write(tmp_path / "b.tsv", ["wx\tyz", "w\ty"])))
    rebuilt.load_state_dict(trained.state_dict())
    assert rebuilt.vocab == trained.vocab
    assert rebuilt.encode(["ab", "wz"]) == trained.encode(["ab", "wz"])


def test_validation_split_is_seeded_and_holds_out_whole_sources(tmp_path):
    def split(seed):
        data = Seq2SeqDataModule(data_dir=str(tmp_path), num_pairs=2000, val_fraction=0.1, seed=seed)
        data.prepare_data()
        data.setup("fit")
        return data.splits

    first, again, other = split(0), split(0), split(1)
    assert first == again and first["val"] != other["val"]
    sources = {s for pairs in first.values() for s, _ in pairs}
    val_sources = [s for s, _ in first["val"]]
    assert len(val_sources) == len(set(val_sources)) == round(0.1 * len(sources))
    assert not set(val_sources) & {s for s, _ in first["train"]}


def test_a_repeated_source_stays_on_one_side_and_is_validated_once(tmp_path):
    lines = ["a\tx", "b\ty", "a\tz", "c\tw", "a\tx", "d\tv"]
    pairs = [tuple(line.split("\t")) for line in lines]
    for seed in range(4):
        data = Seq2SeqDataModule(path=str(write(tmp_path / "pairs.tsv", lines)), val_fraction=0.25, seed=seed)
        data.setup("fit")
        ((held_out, target),) = data.splits["val"]
        assert target == next(t for s, t in pairs if s == held_out)  # a repeated source's first target
        assert data.splits["train"] == [pair for pair in pairs if pair[0] != held_out]


def test_length_grouping_covers_every_pair_once_with_less_padding(tmp_path):
    torch.manual_seed(0)
    data = Seq2SeqDataModule(data_dir=str(tmp_path), num_pairs=4000, batch_size=32)
    data.prepare_data()
    data.setup("fit")

    def padding_share(loader):
        seen, pad, total = [], 0, 0
        for batch in loader:
            seen += batch["index"].tolist()
            pad += batch["target_padding_mask"].sum().item()
            total += batch["target_padding_mask"].numel()
        assert sorted(seen) == list(range(len(data.splits["train"])))
        return pad / total

    grouped = padding_share(data.train_dataloader())
    data.hparams.group_by_length = False
    shuffled = padding_share(data.train_dataloader())
    assert grouped < 0.1 < shuffled


def test_length_grouped_shards_get_equal_batch_counts_and_disjoint_pairs():
    lengths = torch.randint(1, 60, (1001,)).tolist()
    shards = []
    for rank in range(2):
        sampler = DistributedSampler(range(1001), num_replicas=2, rank=rank, shuffle=True, seed=3)
        shards.append(list(LengthGroupedBatchSampler(sampler, batch_size=16, drop_last=False, lengths=lengths)))
    assert len(shards[0]) == len(shards[1]) == len(LengthGroupedBatchSampler(range(501), 16, False, lengths))
    first, second = ({i for batch in shard for i in batch} for shard in shards)
    assert len(first | second) == 1001


def test_worker_processes_give_the_same_batches_as_the_main_process(tmp_path):
    def batches(num_workers):
        data = Seq2SeqDataModule(data_dir=str(tmp_path), num_pairs=300, batch_size=16, num_workers=num_workers)
        data.prepare_data()
        data.setup("fit")
        return list(data.val_dataloader())

    for in_main, in_workers in zip(batches(0), batches(2), strict=True):
        assert in_main.keys() == in_workers.keys()
        assert all(torch.equal(in_main[key], in_workers[key]) for key in in_main)


@pytest.mark.parametrize(
    ("accelerator", "num_workers", "expected"),
    [
        (CPUAccelerator(), None, 0),  # workers would compete with the training processes for the cores
        (CUDAAccelerator(), None, 4),  # 16 cores / 2 processes, less the training process, capped at 4
        (CUDAAccelerator(), 1, 1),
        (CPUAccelerator(), 2, 2),
    ],
)
def test_worker_count_follows_the_device_unless_set(tmp_path, monkeypatch, accelerator, num_workers, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    data = Seq2SeqDataModule(data_dir=str(tmp_path), num_pairs=300, num_workers=num_workers)
    data.trainer = SimpleNamespace(
        accelerator=accelerator, num_devices=2, world_size=1, strategy=SimpleNamespace(cluster_environment=None)
    )
    data.prepare_data()
    data.setup("fit")
    loader = data.val_dataloader()
    assert loader.num_workers == expected
    assert loader.persistent_workers == (expected > 0)
    assert loader.pin_memory == isinstance(accelerator, CUDAAccelerator)


def test_pinned_memory_and_kept_workers_can_be_turned_off_on_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    data = Seq2SeqDataModule(data_dir=str(tmp_path), num_pairs=300, pin_memory=False, persistent_workers=False)
    data.trainer = SimpleNamespace(
        accelerator=CUDAAccelerator(), num_devices=2, world_size=1, strategy=SimpleNamespace(cluster_environment=None)
    )
    data.prepare_data()
    data.setup("fit")
    loader = data.val_dataloader()
    assert (loader.num_workers, loader.persistent_workers, loader.pin_memory) == (4, False, False)


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        (LightningEnvironment(), 1),  # the node's 4 cores shared by its 2 processes, less the process itself
        (SLURMEnvironment(), 3),  # srun bound the task to 4 cores of its own (--cpus-per-task=4)
    ],
)
def test_workers_count_a_slurm_tasks_cores_once(tmp_path, monkeypatch, environment, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    data = Seq2SeqDataModule(data_dir=str(tmp_path), num_pairs=300)
    data.trainer = SimpleNamespace(
        accelerator=CUDAAccelerator(),
        num_devices=2,
        world_size=1,
        strategy=SimpleNamespace(cluster_environment=environment),
    )
    data.prepare_data()
    data.setup("fit")
    assert data.val_dataloader().num_workers == expected


def test_predict_loader_keeps_input_indices(tmp_path):
    path = write(tmp_path / "in.txt", ["12", "7", "123456"])
    data = Seq2SeqDataModule(data_dir=str(tmp_path), predict_path=str(path), batch_size=2)
    data.setup("predict")
    batches = list(data.predict_dataloader())
    assert [i for b in batches for i in b["index"].tolist()] == [0, 1, 2]
    assert "target" not in batches[0]


def test_a_file_too_small_for_the_processes_is_named_before_any_starts(run_cli, capsys, tmp_path):
    pairs = write(tmp_path / "pairs.tsv", ["1\tone", "2\ttwo", "3\tthree"])
    args = ["fit", "-c", DDP_YAML, "-c", SEQ2SEQ_YAML, "--trainer.accelerator=cpu", f"--data.init_args.path={pairs}"]
    with pytest.raises(SystemExit) as exit_:
        run_cli(*args, "--trainer.devices=2")  # refused in this process: a second one would start only later
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"error: data.path {pairs} holds 3 distinct sources: data.val_fraction=0.025 holds out 1 for validation and "
        "leaves 2 to train on, and each of the 2 processes needs at least one of each. Give at least 60 pairs with "
        "distinct sources, or start fewer processes (trainer.devices, trainer.num_nodes)." in err
    )
    assert "Traceback" not in err and not (tmp_path / "logs").exists()

    with pytest.raises(SystemExit):
        run_cli(*args, "--trainer.devices=2", "--data.init_args.val_fraction=0.5")
    assert "holds out 2 for validation and leaves 1 to train on" in capsys.readouterr().err

    with pytest.raises(SystemExit):
        run_cli(
            "validate", *args[1:], "--trainer.devices=2", "--data.init_args.path=null", "--data.init_args.num_pairs=5"
        )
    err = capsys.readouterr().err
    assert "error: the built-in corpus of data.num_pairs=5 holds 5 distinct sources" in err
    assert "Set data.num_pairs to 60, raise data.val_fraction to 0.4, or start fewer processes" in err
