"""What tools/build_site.py and the site's Sphinx extension put on the pages and
how they fail on a damaged notebook. Sphinx is not needed here: these
are the pieces the full build (tests/infra/test_site.py) assembles."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "docs" / "site" / "_ext"))

import accumlab_site  # noqa: E402
import build_site  # noqa: E402
import check_site  # noqa: E402

LESSONS = sorted(p.stem for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PNG = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
    )
).decode()


def _notebook(path: Path, cells: list[dict]) -> Path:
    path.write_text(json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": cells}), encoding="utf-8")
    return path


def _figure_cell(png: str) -> dict:
    return {
        "cell_type": "code", "id": "fig", "metadata": {}, "execution_count": 1, "source": "plt.show()",
        "outputs": [{"output_type": "display_data", "metadata": {}, "data": {"image/png": png, "text/plain": "<Figure>"}}],
    }  # fmt: skip


# --- a damaged notebook is named, with what is wrong --------------------


def test_a_sound_notebook_with_a_figure_reads(tmp_path):
    nb = build_site.read_notebook(_notebook(tmp_path / "01_x.ipynb", [_figure_cell(PNG)]))
    assert nb["cells"][0]["source"] == "plt.show()"


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.write_text(p.read_text()[: len(p.read_text()) // 2]), r"01_x\.ipynb is not valid JSON \(.*: line \d+, column \d+"),
        (lambda p: p.write_text('{"nbformat": 4, "metadata": {}}'), r"01_x\.ipynb is not a notebook: it has no list of 'cells'"),
        (lambda p: p.write_text('[1, 2]'), r"01_x\.ipynb is not a notebook"),
        (lambda p: p.write_bytes(b"\xff\xfe{not utf-8"), r"01_x\.ipynb is not UTF-8 text"),
        (lambda p: _notebook(p, [_figure_cell("not base64 at all!!")]), r"01_x\.ipynb, cell 1, output 1: its image/png figure is not base64"),
        (lambda p: _notebook(p, [_figure_cell(PNG[: len(PNG) // 2])]), r"01_x\.ipynb, cell 1, output 1: its image/png figure is cut short or corrupt"),
        (lambda p: _notebook(p, [_figure_cell(base64.b64encode(b"GIF89a not a png at all").decode())]), r"figure is cut short or corrupt"),
        (lambda p: _notebook(p, [{"cell_type": "markdown", "source": 3}]), r"01_x\.ipynb, cell 1: its source is not text"),
        (lambda p: _notebook(p, [{"source": "x"}]), r"01_x\.ipynb, cell 1: not a cell"),
        (lambda p: _notebook(p, [{"cell_type": "code", "metadata": {}, "source": "x"}]), r"01_x\.ipynb does not match the notebook format \(.*outputs"),
    ],
)
def test_a_damaged_notebook_is_named_with_what_is_wrong_and_the_fix(tmp_path, damage, message):
    path = _notebook(tmp_path / "01_x.ipynb", [_figure_cell(PNG)])
    damage(path)
    with pytest.raises(build_site.SiteError, match=message) as caught:
        build_site.read_notebook(path)
    assert "git checkout --" in str(caught.value) and "make notebooks" in str(caught.value)


def test_make_site_on_a_damaged_notebook_prints_one_line_not_a_traceback(tmp_path):
    """The command itself: every lesson copied, one of them cut in half; exit 1 with one
    line naming that file, before Sphinx starts (nothing is written to --out)."""
    notebooks = tmp_path / "notebooks"
    shutil.copytree(REPO / "notebooks", notebooks)
    victim = notebooks / f"{LESSONS[3]}.ipynb"
    victim.write_text(victim.read_text(encoding="utf-8")[:5000], encoding="utf-8")
    run = subprocess.run(
        [sys.executable, str(REPO / "tools" / "build_site.py"), "--notebooks", str(notebooks),
         "--out", str(tmp_path / "site"), "--work", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("build_site: "), lines
    assert f"{LESSONS[3]}.ipynb is not valid JSON" in lines[0]
    assert not (tmp_path / "site").exists()


# --- alt text --------------------------------------------------------------------------------


def test_a_figure_is_described_by_its_alt_text_else_its_title_else_the_text_above_it():
    assert build_site.figure_alt('ax.set_title("same window, two clipping rules")', "", "4. Clip") == (
        "Figure: same window, two clipping rules (section “4. Clip”)"
    )
    alt = build_site.figure_alt('plot(x, title=f"bf16, batch {plan.b:.2f}")', "", "")
    assert alt == "Figure: bf16, batch plan.b"  # a field by its expression, not an ellipsis
    alt = build_site.figure_alt("draw()", "Peak memory per phase: `m` grows. More text.", "## 2. Peak")
    assert alt == "Figure: Peak memory per phase (section “2. Peak”)"
    alt = build_site.figure_alt("draw()", "9. Putting it together: a tiny GPT trains.", "")
    assert alt == "Figure: Putting it together"  # a section number is not the sentence
    given = "Peak memory against m: it grows with m, accumulation keeps it flat."
    assert build_site.figure_alt('ax.set_title("x")', "", "1. Why", given) == (
        "Figure: Peak memory against m: it grows with m, accumulation keeps it flat (section “1. Why”)"
    )
    assert build_site.figure_alt("draw()", "", "5. `window_boundary`") == "Figure: a figure (section “5. window_boundary”)"


def test_every_saved_figure_of_the_course_gets_alt_text():
    for stem in LESSONS:
        nb = build_site.read_notebook(REPO / "notebooks" / f"{stem}.ipynb")
        build_site.add_figure_alts(nb)
        for cell in nb["cells"]:
            if any("image/png" in o.get("data", {}) for o in cell.get("outputs", [])):
                alt = cell["metadata"]["mystnb"]["image"]["alt"]
                assert alt.startswith("Figure: ") and len(alt) > 20, (stem, alt)


# --- exercises -----------------------------------------------------------------------------


def test_each_lesson_lists_every_exercise_its_notebook_checks_with_hints_and_solution():
    total = 0
    for stem in LESSONS:
        nb = build_site.read_notebook(REPO / "notebooks" / f"{stem}.ipynb")
        found = build_site.lesson_exercises(stem, nb)
        assert [e["path"] for e in found] == check_site.notebook_exercises(REPO / "notebooks" / f"{stem}.ipynb")
        for exercise in found:
            assert exercise["hints"] and exercise["solution"] and exercise["practises"], exercise["path"]
            assert exercise["kind"] in ("predict first", "write code")
            box = build_site.exercise_box(exercise)
            assert box.count("<details") == 2 and not re.search(r"<details[^>]*\bopen\b", box)  # folded
        total += len(found)
    assert total >= 30


def test_a_notebook_checking_an_exercise_its_module_lacks_stops_the_build():
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "source": "ex01.no_such_exercise.check(f)"}]}
    with pytest.raises(build_site.SiteError, match="ex01.no_such_exercise"):
        build_site.lesson_exercises("01_single_device_loop", nb)


def test_a_lesson_without_a_checker_module_has_no_exercises():
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": "## 1. Audit your job\n"}]}
    assert build_site.lesson_exercises("98_future_lesson", nb) == []


def test_the_exercise_index_links_each_exercise_to_its_section():
    stem = "01_single_device_loop"
    nb = build_site.read_notebook(REPO / "notebooks" / f"{stem}.ipynb")
    page = build_site.exercises_page([(stem, "01 · Loop", build_site.lesson_exercises(stem, nb))])
    assert "[`ex01.accumulate_from_means`](lessons/01_single_device_loop.ipynb#6-exercise-accumulate-from-mean-losses)" in page


# --- search ---------------------------------------------------------------------------------


def test_the_terms_a_lesson_teaches_come_from_its_readme_row():
    row = build_site.course_rows((REPO / "README.md").read_text(encoding="utf-8"))
    terms = build_site.teaching_terms(row["05_memory_instrumentation"][0])
    assert "OOM" in terms and "ChunkedNextTokenLoss" in terms and "m" not in terms
    assert "no_sync" in build_site.teaching_terms(row["04_ddp_no_sync"][0])


def test_a_term_is_indexed_at_the_first_section_that_uses_it_or_its_synonym():
    nb = {"cells": [
        {"cell_type": "markdown", "source": "# 05 · Memory\n\nintro mentions OOM before any section\n"},
        {"cell_type": "markdown", "source": "## 1. The meter\n\nno term here\n"},
        {"cell_type": "code", "source": "x = 1\n"},
        {"cell_type": "markdown", "source": "tail of 1\n\n## 2. When a window does not fit\n\ntorch raises OutOfMemoryError\n"},
    ]}  # fmt: skip
    build_site.add_search_terms(nb, ["OOM", "absent"])
    assert nb["cells"][3]["source"] == "tail of 1\n\n```{index} !OOM\n```\n\n## 2. When a window does not fit\n\ntorch raises OutOfMemoryError\n"
    assert "index" not in nb["cells"][0]["source"] + nb["cells"][1]["source"]


# --- the reference ------------------------------------------------------------------


def test_the_reference_names_a_subpackage_it_cannot_import_instead_of_crashing(monkeypatch):
    real = build_site.importlib.import_module

    def fake(name, *args):
        if name == "accumlab.hf":
            raise ImportError("No module named 'transformers'")
        return real(name, *args)

    monkeypatch.setattr(build_site, "_public_modules", lambda: ["distributed", "hf"])
    monkeypatch.setattr(build_site.importlib, "import_module", fake)
    api = build_site.api_entries()
    assert "## `accumlab.hf`\n\nNot importable where this site was built (No module named 'transformers')" in api
    assert ".. automodule:: accumlab.distributed\n" in api


def test_names_in_the_lessons_text_resolve_to_their_reference_entry():
    targets = accumlab_site.public_targets()
    cases = {
        "al.train_window": "accumlab.train_window",
        "al.train_window(model, window, optimizer)": "accumlab.train_window",
        "accumlab.MemoryMeter": "accumlab.MemoryMeter",
        "MemoryMeter.plot": "accumlab.MemoryMeter",
        "al.distributed.shard": "accumlab.distributed.shard",
        "ex01.adamw_ratio.check": "accumlab_course.exercises.ex01.adamw_ratio",
        "ex01.adamw_ratio.hint()": "accumlab_course.exercises.ex01.adamw_ratio",
        "train_window": "accumlab.train_window",
    }
    for text, target in cases.items():
        assert accumlab_site.target_of(text, targets) == target, text
    for text in ("train", "model.zero_grad()", "A", "loss.backward()", "x = al.train_window"):
        assert accumlab_site.target_of(text, targets) is None, text


# --- figures open full size -------------------------------------------------------------


def test_saved_figures_link_to_themselves_and_other_images_do_not():
    body = '<img alt="Figure: x" src="../_images/ab.png" /><img src="data:image/png;base64,xx" alt="w"><img src="../_static/logo.svg">'
    out = accumlab_site.link_figures(body)
    assert '<a class="al-figure" href="../_images/ab.png"' in out
    assert out.count("<a ") == 1


# --- make site takes PyTorch's CPU build on a fresh clone --------------------------


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize(
    "args, env, index",
    [
        ([], {}, "--index-url https://download.pytorch.org/whl/cpu"),
        (["TORCH_INDEX=cu128"], {}, "--index-url https://download.pytorch.org/whl/cu128"),
        ([], {"TORCH_INDEX": "cu126"}, "--index-url https://download.pytorch.org/whl/cu126"),
    ],
)
def test_make_site_on_a_fresh_clone_installs_no_cuda_build_unless_asked(tmp_path, args, env, index):
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / "course").mkdir()
    for name in ("Makefile", "pyproject.toml", "constraints.txt", "course/pyproject.toml"):
        shutil.copy(REPO / name, clone / name)
    environ = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX"} | env
    run = subprocess.run(["make", "-n", "site", *args], cwd=clone, capture_output=True, text=True, env=environ)
    assert run.returncode == 0, run.stderr
    installs = [line for line in run.stdout.splitlines() if "pip install" in line and '"torch==' in line]
    assert installs and index in installs[0], installs
    assert "CUDA build, several GB" not in run.stdout


def test_the_cuda_hint_names_the_command_that_was_run(tmp_path):
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / "course").mkdir()
    for name in ("Makefile", "pyproject.toml", "constraints.txt", "course/pyproject.toml"):
        shutil.copy(REPO / name, clone / name)
    environ = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX"}
    for goal in ("site", "test"):
        run = subprocess.run(["make", "-n", goal, "TORCH_INDEX="], cwd=clone, capture_output=True, text=True, env=environ)
        assert f"run make {goal} TORCH_INDEX=cpu" in run.stdout, run.stdout[:500]


# --- lessons come from the files: a ninth appears without a list to update ----------------


def test_a_new_lesson_notebook_appears_on_the_site_and_in_the_exercise_index(tmp_path, capsys):
    notebooks = tmp_path / "notebooks"
    shutil.copytree(REPO / "notebooks", notebooks)
    _notebook(notebooks / "98_a_new_lesson.ipynb", [
        {"cell_type": "markdown", "id": "t", "metadata": {}, "source": "# 98 · A new lesson\n\nIntro.\n"},
        {"cell_type": "markdown", "id": "s", "metadata": {}, "source": "## 1. A section\n\nText.\n"},
    ])  # fmt: skip
    stems = build_site.assemble(tmp_path / "src", notebooks)
    assert stems[-1] == "98_a_new_lesson" and len(stems) == len(LESSONS) + 1
    index = (tmp_path / "src" / "index.md").read_text(encoding="utf-8")
    assert "lessons/98_a_new_lesson\n" in index  # in the sidebar's lessons
    assert "[98 · A new lesson](lessons/98_a_new_lesson.ipynb)" in index  # in the lessons' table
    assert "not measured" in index
    exercises = (tmp_path / "src" / "exercises.md").read_text(encoding="utf-8")
    assert "## 98 · A new lesson\n\nNo exercise in this lesson." in exercises
    assert (tmp_path / "src" / "_notebooks" / "98_a_new_lesson.ipynb").is_file()
    err = capsys.readouterr().err
    assert "README.md's course table has no row for 98_a_new_lesson" in err
    assert "docs/WORKSHOP.md's run-all table has no time for 98_a_new_lesson" in err
