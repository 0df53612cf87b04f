"""Tests for accumlab_course.data and the committed data set generator."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import accumlab_course.data as data_module
from accumlab_course.data import (
    DATA_PATH,
    EOS_ID,
    PAD_ID,
    VOCAB_CHARS,
    VOCAB_SIZE,
    Example,
    collate,
    decode,
    encode,
    load_examples,
    make_classification,
    microbatches,
)

REPO = Path(__file__).resolve().parents[2]


def load_generator() -> ModuleType:
    """Import data/make_dataset.py (a script, not a package module) in-process."""
    path = REPO / "data" / "make_dataset.py"
    spec = importlib.util.spec_from_file_location("accumlab_make_dataset", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def records() -> list[dict]:
    with DATA_PATH.open("r", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def hand_made() -> list[Example]:
    """Two examples: prompt "ab" + response "c" + EOS, and prompt "x" + response "yz" + EOS."""
    return [
        Example(id=7, input_ids=encode("ab") + encode("c") + [EOS_ID], prompt_len=2),
        Example(id=3, input_ids=encode("x") + encode("yzw") + [EOS_ID], prompt_len=1),
    ]


# --- vocabulary -------------------------------------------------------------------


def test_vocabulary_layout() -> None:
    assert PAD_ID == 0 and EOS_ID == 1
    assert VOCAB_SIZE == 2 + len(VOCAB_CHARS)
    assert len(set(VOCAB_CHARS)) == len(VOCAB_CHARS)
    assert encode("\n") == [2]


def test_encode_decode_round_trip() -> None:
    text = "reverse: Hello, World 42!\n"
    ids = encode(text)
    assert len(ids) == len(text)
    assert all(2 <= i < VOCAB_SIZE for i in ids)
    assert decode(ids) == text
    assert decode(torch.tensor(ids + [EOS_ID, PAD_ID, PAD_ID])) == text


def test_unknown_character_raises() -> None:
    with pytest.raises(ValueError, match=r"'é' at position 3"):
        encode("café")
    with pytest.raises(ValueError, match="vocabulary"):
        encode("tab\there")


def test_decode_rejects_out_of_range_ids() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decode([VOCAB_SIZE])


# --- the committed data set -------------------------------------------------------


def test_data_set_is_package_data() -> None:
    # Shipped inside the package (so a wheel carries it), where the generator writes it.
    package_dir = Path(data_module.__file__).resolve().parent
    assert Path(str(DATA_PATH)).resolve() == package_dir / "instructions.jsonl"
    assert load_generator().OUTPUT_PATH.resolve() == package_dir / "instructions.jsonl"
    assert not (REPO / "data" / "instructions.jsonl").exists()


def test_committed_file_matches_generator() -> None:
    gen = load_generator()
    lines = gen.generate()
    assert DATA_PATH.read_text(encoding="utf-8") == "".join(lines)
    assert gen.check(DATA_PATH)
    assert gen.generate() == lines  # deterministic


def test_generator_check_detects_a_stale_file(tmp_path: Path) -> None:
    gen = load_generator()
    stale = tmp_path / "instructions.jsonl"
    stale.write_text("".join(gen.generate()[:-1]), encoding="utf-8")
    assert not gen.check(stale)
    assert not gen.check(tmp_path / "missing.jsonl")


def test_data_set_shape(records: list[dict]) -> None:
    assert 1500 <= len(records) <= 3000
    assert [r["id"] for r in records] == list(range(len(records)))
    assert all(set(r) == {"id", "prompt", "response"} for r in records)
    assert all(r["prompt"].endswith("\n") for r in records)
    assert max(len(r["prompt"]) + len(r["response"]) + 1 for r in records) <= 127
    assert len(DATA_PATH.read_bytes()) < 300_000


def test_lengths_spread_widely(records: list[dict]) -> None:
    responses = [len(r["response"]) for r in records]
    prompts = [len(r["prompt"]) for r in records]
    assert min(responses) == 1 and max(responses) >= 40
    assert set(range(1, 41)) <= set(responses)
    assert max(prompts) - min(prompts) >= 30
    assert statistics.pstdev(responses) > 8


def test_answers_are_correct(records: list[dict]) -> None:
    """Every response is the right answer to its prompt."""
    for r in records:
        task, _, arg = r["prompt"].rstrip("\n").partition(": ")
        if task == "reverse":
            expected = arg[::-1]
        elif task == "upper":
            expected = arg.upper()
        elif task == "sort":
            expected = "".join(sorted(arg))
        elif task == "count":
            expected = str(len(arg))
        else:
            word, k = task.split()
            assert word == "repeat"
            expected = arg * int(k)
        assert r["response"] == expected, r


# --- loading ----------------------------------------------------------------------


def test_load_examples(records: list[dict]) -> None:
    examples = load_examples(limit=10)
    assert len(examples) == 10
    for ex, r in zip(examples, records[:10], strict=True):
        assert ex.id == r["id"]
        assert ex.prompt_len == len(r["prompt"])
        assert ex.input_ids[-1] == EOS_ID
        assert decode(ex.input_ids[: ex.prompt_len]) == r["prompt"]
        assert decode(ex.input_ids[ex.prompt_len :]) == r["response"]
    assert len(load_examples()) == len(records)
    assert load_examples(limit=0) == []


def test_load_examples_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="make_dataset.py"):
        load_examples(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_examples(str(tmp_path / "nope.jsonl"))


def test_load_examples_missing_shipped_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(data_module, "DATA_PATH", tmp_path / "gone.jsonl")
    with pytest.raises(FileNotFoundError, match="reinstall accumlab"):
        load_examples()


def test_load_examples_bad_record(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 0, "prompt": "a\\n", "response": "\\u00e9"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_examples(path)


def test_example_validates() -> None:
    with pytest.raises(ValueError, match="no tokens"):
        Example(id=0, input_ids=[], prompt_len=0)
    with pytest.raises(ValueError, match="prompt_len"):
        Example(id=0, input_ids=[2, 3], prompt_len=3)


# --- collate ----------------------------------------------------------------------


def test_collate_pads_and_masks_prompt() -> None:
    batch = collate(hand_made())
    assert set(batch) == {"input_ids", "attention_mask", "labels", "example_ids"}
    assert all(t.dtype == torch.long for t in batch.values())
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.shape == mask.shape == labels.shape == (2, 5)
    a, b, c = encode("abc")
    x, y, z, w = encode("xyzw")
    assert ids.tolist() == [[a, b, c, EOS_ID, PAD_ID], [x, y, z, w, EOS_ID]]
    assert mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert labels.tolist() == [[-100, -100, c, EOS_ID, -100], [-100, y, z, w, EOS_ID]]
    assert batch["example_ids"].tolist() == [7, 3]
    # Targets after the shift: response length + 1 (EOS) per example.
    assert (labels[:, 1:] != -100).sum(dim=1).tolist() == [1 + 1, 3 + 1]


def test_collate_without_prompt_mask_and_custom_ids() -> None:
    batch = collate(hand_made(), mask_prompt=False, ignore_index=-1, pad_id=5)
    labels = batch["labels"]
    assert batch["input_ids"][0, -1].item() == 5
    assert labels[0].tolist() == batch["input_ids"][0, :4].tolist() + [-1]
    # Every real token but the first is a target: length - 1 per example.
    assert (labels[:, 1:] != -1).sum(dim=1).tolist() == [3, 4]


def test_collate_target_count_matches_response_length() -> None:
    examples = load_examples(limit=50)
    batch = collate(examples)
    counts = (batch["labels"][:, 1:] != -100).sum(dim=1)
    expected = [len(ex.input_ids) - ex.prompt_len for ex in examples]  # response + EOS
    assert counts.tolist() == expected


def test_collate_empty_raises() -> None:
    with pytest.raises(ValueError, match="at least one example"):
        collate([])


# --- microbatches -----------------------------------------------------------------


def test_microbatches_split_in_order() -> None:
    examples = load_examples(limit=10)
    mbs = microbatches(examples, 4)
    assert [len(mb["example_ids"]) for mb in mbs] == [4, 4, 2]
    assert torch.cat([mb["example_ids"] for mb in mbs]).tolist() == list(range(10))


def test_microbatches_shuffle_is_seeded_and_keeps_every_example() -> None:
    examples = load_examples(limit=10)
    first = microbatches(examples, 3, shuffle=True, seed=1)
    again = microbatches(examples, 3, shuffle=True, seed=1)
    other = microbatches(examples, 3, shuffle=True, seed=2)
    order = torch.cat([mb["example_ids"] for mb in first]).tolist()
    assert order == torch.cat([mb["example_ids"] for mb in again]).tolist()
    assert order != torch.cat([mb["example_ids"] for mb in other]).tolist()
    assert sorted(order) == list(range(10)) and order != list(range(10))
    assert [ex.id for ex in examples] == list(range(10))  # input untouched


def test_microbatches_pass_collate_options() -> None:
    mbs = microbatches(hand_made(), 2, mask_prompt=False)
    assert (mbs[0]["labels"][:, 1:] != -100).sum().item() == 3 + 4


def test_microbatches_bad_size_and_empty() -> None:
    with pytest.raises(ValueError, match="micro_batch_size"):
        microbatches(hand_made(), 0)
    with pytest.raises(ValueError, match="at least one example"):
        microbatches([], 2)


# --- make_classification --------------------------------------------------------------


def test_make_classification() -> None:
    x, y = make_classification(64, in_features=5, out_features=4, seed=3)
    assert x.shape == (64, 5) and x.dtype == torch.float32
    assert y.shape == (64,) and y.dtype == torch.long
    assert 0 <= y.min().item() and y.max().item() < 4
    assert len(set(y.tolist())) > 1
    x2, y2 = make_classification(64, in_features=5, out_features=4, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    with pytest.raises(ValueError):
        make_classification(0)
