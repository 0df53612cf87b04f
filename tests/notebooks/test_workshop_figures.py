"""docs/WORKSHOP.md quotes the notebooks' saved outputs, and its plan gives every lesson
the time its core path takes.

Every FIGURES row pairs a pattern in the kit with a pattern in one notebook's saved
outputs; both must match, and the captured figures must be equal as printed (a kit that
said 0.99 where 06 saved 0.98 fails): re-execute a notebook, then update the kit. The plan
is read from the kit's table and compared with tools/course_time.py's core minutes and
core exercises and predictions of each lesson.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
from course_time import measure

REPO = Path(__file__).resolve().parents[2]
KIT = (REPO / "docs" / "WORKSHOP.md").read_text(encoding="utf-8")

#: (what, pattern in docs/WORKSHOP.md, notebook, pattern in its saved outputs); each
#: pattern captures the same figures in the same order (whitespace inside a capture is
#: compared as one space, so a figure may wrap in the kit).
FIGURES = [
    ("00 peak memory at 32 examples",
     r"at 32 examples per update the\s+peak is (\d+\.\d) MiB in one pass and (\d+\.\d) MiB",
     "00_start_here",
     r"32 examples per update: peak +(\d+\.\d) MiB in one pass, +(\d+\.\d) MiB in microbatches"),
    ("00 update attempts", r"`update_attempts` = (\d+)", "00_start_here",
     r"5 microbatches and backward passes, (\d+) update attempts"),
    ("00 effective batch", r"`effective_batch` = (\d+)", "00_start_here",
     r"8 GPUs as 2 replicas of T=2 × P=2 +8 +2 +4 +8 +(\d+)"),
    ("01 zero_grad placements",
     r"inside the microbatch loop gives a\s+max relative gradient error of (\S+), forgotten (\d+);",
     "01_single_device_loop",
     r"zero_grad inside the microbatch loop +max relative gradient error (\S+)\n"
     r"zero_grad forgotten \(second window\) +max relative gradient error (\S+)"),
    ("01 SGD and AdamW without / A", r"SGD's update is (\d\.\d{4}) ×,\s+AdamW's (\d\.\d{4}) ×",
     "01_single_device_loop",
     r"SGD +update without / with the division by A = 3: (\d\.\d{4})\n"
     r"AdamW +update without / with the division by A = 3: (\d\.\d{4})"),
    ("01 undivided one-weight gradient", r"add to (\d+)\s+undivided", "01_single_device_loop",
     r"undivided, w\.grad = \+(\d+)\.00"),
    ("01 the events of one window", r"one `train_window` call, (clear → F0[^;]*→ clear);",
     "01_single_device_loop", r"(clear → F0 .* → clear)\n"),
    ("02 targets after the shift",
     r"\((\d+) with the prompt masked, (\d+) without, of (\d+)\s+positions\)", "02_token_weighting",
     r"targets: (\d+) with the prompt masked, (\d+) without; positions after the shift: (\d+)"),
    ("02 token mean and average of averages",
     r"the token mean (\d\.\d), the average of\s+averages (\d\.\d);", "02_token_weighting",
     r"token mean \(1024 \+ 6144\) / 2048 = (\d\.\d)000 .*\naverage of averages \(2 \+ 4\) / 2 = (\d\.\d)000"),
    ("02 second contribution", r"`second_contribution` = (\d\.\d+)", "02_token_weighting",
     r"each microbatch adds loss_sum / 8: \[0\.25, (\d\.\d+)\]"),
    ("02 the gradient error on the tiny GPT",
     r"average of averages has a cosine of (\d\.\d+) with the\s+full batch's gradient "
     r"\(length × (\d\.\d+)\), counting positions (\d\.\d+) \(length × (\d\.\d+):",
     "02_token_weighting",
     r"average of averages +cosine with the full batch's gradient (\d\.\d+), length × (\d\.\d+)\n"
     r"positions counted +cosine with the full batch's gradient (\d\.\d+), length × (\d\.\d+)"),
    ("03 fp16 underflow", r"\((1e-8) cast to fp16 is (\d+)\)", "03_amp_gradscaler",
     r"(1e-8) cast to fp16: (\d+);"),
    ("03 one scale per window", r"one scale\s+\((\d+), then (\d+), then (\d+)\)", "03_amp_gradscaler",
     r"window 0: its 4 microbatches scaled by \[(\d+)\.0\][\s\S]*?"
     r"window 1: its 4 microbatches scaled by \[(\d+)\.0\][\s\S]*?"
     r"window 2: its 4 microbatches scaled by \[(\d+)\.0\]"),
    ("03 clip the window or each microbatch",
     r"\((\d+\.\d) degrees, norm (\d\.\d\d)\), clipping\s+each microbatch turns it "
     r"\((\d+\.\d) degrees, norm (\d\.\d\d)\)", "03_amp_gradscaler",
     r"clip the window +direction +(\d+\.\d) deg, norm (\d\.\d\d)\n"
     r"clip each, then add +direction +(\d+\.\d) deg, norm (\d\.\d\d)"),
    ("03 the skipped attempt",
     r"halves the scale\s+\((\d+) → (\d+)\) and leaves the weights:\s+(\d) update attempts, (\d) "
     r"applied, (\d) skipped", "03_amp_gradscaler",
     r"1 \| False +\| +(\d+) -> (\d+)[\s\S]*ledger: (\d) attempts, (\d) applied, (\d) skipped"),
    ("03 AdamW steps after the skip", r"`adamw_steps_after_skip` = (\d+)", "03_amp_gradscaler",
     r"\| +(\d+)\nledger:"),
    ("04 the arithmetic cell", r"true mean (\d\.\d\d), (\d\.\d\d) without `× D`, (\d\.\d\d) with",
     "04_ddp_no_sync", r"true window mean (\d\.\d\d) \| × D / global count: \d\.\d\d \| "
     r"/ global count: (\d\.\d\d) \| / local count: (\d\.\d\d)"),
    ("04 per-rank counts", r"`local_count_mean` = (\d\.\d)", "04_ddp_no_sync",
     r"/ local count: (\d\.\d)\d"),
    ("04 syncs per window",
     r"syncs per window: (\d) with `no_sync` around forward and backward, (\d) around\s+neither, "
     r"(\d) around the forwards only, (\d) around the backwards only", "04_ddp_no_sync",
     r"forward and backward +(\d) +1  True\nnone +(\d) +1  True\nforward only +(\d) +1  True\n"
     r"backward only +(\d) +1  True"),
    ("04 syncs with no_sync around the forwards", r"`syncs_forward_only` = (\d)", "04_ddp_no_sync",
     r"forward only +(\d) +\d+  True"),
    ("04 the whole window",
     r"window 1 skipped on both ranks \((\d+) → (\d+)\),\s+window 2 at lr (\d\.\d\d)",
     "04_ddp_no_sync",
     r"1 \| +3, 2 \| +1, 1 \| False +\| +(\d+) -> (\d+) +\| +- \| skipped\n"
     r" +2 \|[^\n]*\| (\d\.\d\d) \| True"),
    ("04 example IDs", r"§6\s+(\d+) examples each exactly once", "04_ddp_no_sync",
     r"the uneven run of section 5: (\d+) examples processed over 2 rank\(s\) \(\[\d+, \d+\]\), "
     r"\d+ distinct; each\s+exactly once"),
    ("05 the four parts of a window",
     r"(\d\.\d\d) at the start, the gradients (\d\.\d\d) from the first\s+backward, (\d\.\d\d) more "
     r"from the second, AdamW's state (\d\.\d\d) at the first update, (\d\.\d\d) at the\s+next",
     "05_memory_instrumentation",
     r"window 0 starts with \(the weights\) +(\d\.\d\d) × weights\n"
     r"backward 0 leaves \(the gradients\) +(\d\.\d\d) × weights\n"
     r"backward 1 leaves \(added in place\) +(\d\.\d\d) × weights\n"
     r"the first update leaves \(AdamW's state\) +(\d\.\d\d) × weights\n"
     r"window 1 starts with +(\d\.\d\d) × weights"),
    ("05 momentum baseline", r"`momentum_baseline` = (\d)", "05_memory_instrumentation",
     r"SGD \+ momentum .* window 1 starts at (\d)\.00 ×"),
    ("05 losses kept in a list",
     r"grows by (\[[\d, ]+\]) bytes over three windows[\s\S]*?stays at (\[[\d, ]+\])",
     "05_memory_instrumentation",
     r"tensors kept: (\[[\d, ]+\])\n.*floats: (\[[\d, ]+\])"),
    ("06 BatchNorm rows", r"BatchNorm does not\s+\(a difference of (\d+\.\d+)\)",
     "06_when_equivalence_ends", r"BatchNorm: rows 0-7 .* max \|difference\| = (\d+\.\d+)"),
    ("06 BatchNorm error at m = 32 and m = 2",
     r"\((\d+\.\d+) at `m = 32` up to (\d+\.\d+) at\s+`m = 2`\)", "06_when_equivalence_ends",
     r"m=32 × A= 2: max relative gradient error (\d+\.\d+)\n(?:.*\n)*?"
     r"m= 2 × A=32: max relative gradient error (\d+\.\d+)"),
    ("06 BatchNorm passes", r"`batchnorm_passes` = (\d+)", "06_when_equivalence_ends",
     r"num_batches_tracked: \d+ \(m=64\), (\d+) \(m=8 × A=8\)"),
    ("06 dropout", r"dropout (\d\.\d+) in training mode, below (\S+) in eval mode",
     "06_when_equivalence_ends",
     r"dropout 0\.1, training mode: +max relative gradient error (\d\.\d+)\n"
     r"same model, eval mode \(no drop\): max relative gradient error < (\S+)"),
    ("06 examples at 16 updates", r"`examples_at_16_updates` =\s+(\d+)", "06_when_equivalence_ends",
     r"after 16 updates: +A=1, lr 3e-3 +(\d+) examples seen"),
    ("06 held-out losses", r"`A = 1` ends lower: (\d\.\d\d) against\s+(\d\.\d\d) after",
     "06_when_equivalence_ends",
     r"A=1, lr 3e-3 +held-out loss (\d\.\d\d)\n.*A=4, lr 3e-3 +held-out loss (\d\.\d\d)"),
    ("06 lr × 2 gaps", r"is (\d\.\d\d) nats at the same learning rate and (\d\.\d\d) at\s+twice it",
     "06_when_equivalence_ends", r"gap to A=1 after 512 examples: (\d\.\d\d) nats at the "
     r"same lr, (\d\.\d\d) at lr × 2"),
    ("06 divided twice", r"your own gives (\d\.\d\d) × the gradient", "06_when_equivalence_ends",
     r"loss_sum / count, then / A +\|gradient\| = (\d\.\d\d) × the right one"),
    ("07 the audit's cost", r"a correct loop costs (\d+) forward passes over (\d+) rows",
     "07_capstone", r"The audit ran (\d+) forward passes over (\d+) rows"),
    ("07 the audit's controlled set", r"(\d+) windows, (\d+) microbatches, (\d+) examples, unequal",
     "07_capstone", r"\((\d+) windows, (\d+) microbatches, (\d+) examples of a controlled set\)"),
    ("07 the real run's update attempts", r"`updates_predicted` = (\d+)", "07_capstone",
     r"\n(\d+) update attempts \(\d+ applied, 0 skipped\) from \d+ microbatches / \d+ backward "
     r"passes\n512 examples"),
    ("07 double division", r"`divides_twice` logs (\d\.\d+) × the right loss",
     "07_capstone", r"divides_twice +(\d\.\d+) "),
    ("07 clears inside, schedules per backward",
     r"`clears_inside`'s update is (\d\.\d+) × as long \(a deep dive adds\s+`schedules_per_backward`,\s+which runs at lr (\d\.\d+)",
     "07_capstone",
     r"clears_inside +- +(\d\.\d+) [\s\S]*?schedules_per_backward +- +\d\.\d+ +\d+% +(\d\.\d+)"),
    ("08 the Trainer's factor", r"`factor_predicted` = (\d+)/(\d+)", "08_audit_your_job",
     r"the gradient is the correct one times \d\.\d+ = (\d+)/(\d+):"),
    ("08 the audit's measurement",
     r"the gradient (\d\.\d+) × the\s+correct one, the `Trainer` counting (\d+) labels where the "
     r"loss scores (\d+) targets", "08_audit_your_job",
     r"gradient = (\d\.\d+) x correct[\s\S]*?divided by (\d+) counted labels\s+where (\d+) targets"),
    ("08 the raising callback", r"stopping with (\d+) updates applied", "08_audit_your_job",
     r"updates applied: (\d+); weights untouched: True"),
]


def _figures(match: re.Match) -> tuple[str, ...]:
    return tuple(" ".join(group.split()) for group in match.groups())


def _shown(output: dict) -> str:
    """A stream's text, or the text of a result's HTML with its tags dropped; of a
    prediction's folded answer, the answer on lines of its own (the kit quotes it for the
    facilitator), without the summary."""
    html_text = "".join(output.get("data", {}).get("text/html", ""))
    if "accumlab-answer" in html_text:
        html_text = "\n" + html_text.split("</summary>", 1)[1] + "\n"
    return "".join(output.get("text", "")) + html.unescape(re.sub(r"<[^>]+>", "", html_text))


def _outputs(notebook: str) -> str:
    data = json.loads((REPO / "notebooks" / f"{notebook}.ipynb").read_text(encoding="utf-8"))
    return "".join(_shown(o) for c in data["cells"] if c["cell_type"] == "code"
                   for o in c.get("outputs", []))


@pytest.mark.parametrize(("what", "in_kit", "notebook", "in_outputs"), FIGURES,
                         ids=[f[0] for f in FIGURES])
def test_the_kit_quotes_the_saved_output(what, in_kit, notebook, in_outputs):
    kit = re.search(in_kit, KIT)
    assert kit, f"docs/WORKSHOP.md no longer quotes {what} as expected: {in_kit!r}"
    saved = re.search(in_outputs, _outputs(notebook))
    assert saved, f"{notebook}'s saved outputs no longer show {what}: {in_outputs!r}"
    assert _figures(kit) == _figures(saved), (
        f"docs/WORKSHOP.md quotes {what} as {kit.groups()}, the saved {notebook} shows "
        f"{saved.groups()}: re-executed notebooks need the kit updated"
    )


def test_the_kit_names_no_internal_issue():
    # Issue numbers are the project's bookkeeping, not something a workshop lead can read.
    assert not re.search(r"\bissues? \d", KIT, flags=re.IGNORECASE)


def _plan() -> list[list[str]]:
    """The rows of the kit's plan table (cells stripped), header and total rows left out."""
    section = KIT[KIT.index("## The plan") :]
    table = section[section.index("\n|") + 1 : section.index("\n\n", section.index("\n|"))]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()]
    return [r for r in rows[2:] if not r[0].startswith("**")]


def _minutes(clock: str) -> int:
    hours, minutes = clock.split(":")
    return 60 * int(hours) + int(minutes)


def test_the_plan_adds_up_clock_minutes_and_total():
    section = KIT[KIT.index("## The plan") :]
    total = int(re.search(r"^\| \*\*total\*\* \| \*\*(\d+)\*\* \|", section, flags=re.M).group(1))
    end = 0
    for row in _plan():
        start, stop = (_minutes(t) for t in row[0].split("–"))
        assert start == end and stop - start == int(row[1]), row
        end = stop
    assert end == total == sum(int(r[1]) for r in _plan())


@pytest.mark.parametrize("path", sorted((REPO / "notebooks").glob("0[1-9]_*.ipynb")), ids=lambda p: p.stem)
def test_the_plan_gives_each_live_lesson_its_core_path(path):
    # 00 is pre-work; every later lesson has a block of at least its core minutes, which
    # names each core exercise and prediction the lesson holds; an optional lesson (outside
    # the core path) has no block: the follow-up table lists it
    timed = measure(path)
    if timed.outside_core:
        assert re.search(rf"^\| {path.stem[:2]} \|", KIT, flags=re.M), f"no follow-up row for {path.stem}"
        return
    core = timed.core
    rows = [r for r in _plan() if r[2].startswith(path.stem[:2] + " ")]
    assert len(rows) == 1, f"the plan has {len(rows)} rows for {path.stem}"
    (row,) = rows
    assert int(row[1]) >= core.minutes, f"{path.stem}: {row[1]} min for a core path of {core.minutes:.1f}"
    for name in sorted(core.exercises | core.predictions):
        assert name.split(".")[1] in " ".join(row[3:]), f"{path.stem}'s block does not name {name}"
