"""Predict, then see: each notebook, read as a learner reads it, shows no prediction's answer
before the learner has acted on the question.

A prediction is a code cell calling ``exNN.<name>.check(...)`` where ``exNN.<name>.kind``
is ``"prediction"``; its answer is ``exNN.<name>.answer``. Its **region** runs from that
question cell down to the next heading (the text of a Markdown cell before a heading line
belongs to the region). The answer is shown only by a **revealing cell** in the region
that calls ``exNN.<name>.reveal(value, shown=...)``: a closed ``<details>`` element whose
summary and plain text never hold it.

What a learner sees, and this test reads, is the same in JupyterLab (folded or not,
before and after Run All: Run All unfolds every output, and a folded output still shows its
first line, so no output counts as hidden), on the site and in the saved file on a code
host: every Markdown cell, every code cell's source, and every output: a stream's text, an
error's traceback, a result's ``text/html`` as the text it renders (JupyterLab, the site and
GitHub prefer it to ``text/plain``), in which a closed ``<details>`` element shows only its
``<summary>``; ``text/plain`` where there is no HTML.

For each prediction, with the answer looked for as a learner would read it (below):

- **the reveal**: a revealing cell in the region, after the question; its outputs are not
  saved collapsed (``jupyter.outputs_hidden``: Run All unfolds them, and the site would fold
  the closed ``<details>`` a second time);
- **the region**: no Markdown, no visible output and no code source in it holds the answer
  (the answer inside a closed ``<details>`` is not visible);
- **above the question**: no Markdown and no visible output holds it, nor a code source of
  the question's section;
- **on the site**: the same for the lesson as ``tools/build_site.py`` assembles it (the box
  under the title, the folded hints and solution under each exercise), and the exercise
  index's line on the prediction does not state it.

How the answer is looked for:

- a **number** as written in text: a numeral whose value is the answer (``128``, ``128.0``,
  ``00000128`` in a file name; a non-whole answer at the precision the numeral shows, from 3
  significant digits, or from the answer's own when it has fewer: ``0.922`` for 0.9223,
  ``3.5`` for 3.5), not a part of another numeral (``1280``, ``12.8``, ``2.13.0``), and a
  product written out (``16 × 8``, ``16 * 8``);
- in **code**: the prose it holds, its comments and strings (``print("80 passes")``), for
  an answer that is not a whole number below 10; a constant expression (``16 * 8``) whose
  value is the answer; and a comparison with the answer (``assert x == 80``,
  ``passes == [10, 80]``). A number used as data (``TinyGPT(n_embd=32)``) states nothing;
- a **choice** (text): the choice's words in text, ignoring case, spaces and hyphens, and in
  code a comparison that names it (``assert cosine(wrong["positions counted"]) > 0.9995``);
  the question's own cells, which list the choices, are not searched.

A whole number below 10 or a choice is common in any text, so above the question it is
looked for only from the question's section heading on; in the region it is looked for
everywhere, since the region is what the learner reads next.
"""

from __future__ import annotations

import ast
import importlib
import io
import json
import math
import re
import tokenize
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CHECK = re.compile(r"\b(ex\d\d)\.(\w+)\.check\(")
HEADING = re.compile(r"^#{1,6}\s")


def _text(value: Any) -> str:
    return "".join(value) if isinstance(value, list) else (value or "")


# --- what a learner sees -------------------------------------------------------------------


class _Visible(HTMLParser):
    """The text an HTML fragment renders, where a closed ``<details>`` shows only its
    ``<summary>``. Tags that are not HTML (``x < 3``) stay text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.closed = 0  # depth inside closed <details>
        self.summary = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._break(tag)
        if tag == "details" and (self.closed or "open" not in dict(attrs)):
            self.closed += 1
        elif tag == "summary" and self.closed:
            self.summary += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "details" and self.closed:
            self.closed -= 1
        elif tag == "summary" and self.summary:
            self.summary -= 1
        self._break(tag)

    def _break(self, tag: str) -> None:
        if tag in _BLOCKS:
            self.parts.append("\n")
        elif tag in ("td", "th"):
            self.parts.append(" ")

    def handle_data(self, data: str) -> None:
        if not self.closed or (self.summary and self.closed == self.summary):
            self.parts.append(data)


_BLOCKS = {"br", "p", "div", "pre", "tr", "li", "table", "details", "summary", "ul", "ol",
           "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "section"}


def rendered(fragment: str) -> str:
    """What ``fragment`` (HTML, or Markdown that may hold HTML) shows before anything is opened."""
    parser = _Visible()
    parser.feed(fragment)
    parser.close()
    return "".join(parser.parts)


def visible_output(output: dict) -> str:
    """The text one saved output shows: a stream or a traceback, else the result's rendered
    ``text/html``, else its ``text/plain``."""
    if output.get("output_type") == "stream":
        return _text(output.get("text"))
    if output.get("output_type") == "error":
        return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(output.get("traceback", [])))
    data = output.get("data", {})
    if "text/html" in data:
        return rendered(_text(data["text/html"]))
    return _text(data.get("text/markdown") or data.get("text/plain"))


# --- how an answer is recognised -----------------------------------------------------------

_NUMERAL = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?([eE][-+]?\d+)?(?!\w|\.\d)")
_PRODUCT = re.compile(r"(?<![\w.])(\d+)\s*[×*]\s*(\d+)(?![\w.])")


def _whole(answer: float) -> bool:
    return float(answer) == int(answer)


def common(answer: object) -> bool:
    """A choice of words, or a whole number below 10: found in any text by chance."""
    return isinstance(answer, str) or (_whole(answer) and abs(answer) < 10)


def _digits(mantissa: str) -> int:
    return len(mantissa.replace(".", "").lstrip("0")) or 1


def numeral_is(token: re.Match[str], answer: float) -> bool:
    """Whether a numeral written in text is ``answer`` at the precision it shows."""
    whole, fraction, exponent = token.group(1).replace(",", ""), token.group(2) or "", token.group(3) or ""
    value = float(whole + fraction + exponent)
    if _whole(answer):
        return value == answer
    shown = _digits(whole + fraction)
    if shown < min(3, _digits(f"{abs(answer):.15e}".split("e")[0].rstrip("0"))):
        return False
    step = 10.0 ** (-len(fraction[1:]) + (int(exponent[1:]) if exponent else 0))
    return abs(value - answer) <= step / 2 * (1 + 1e-9)


def _normal(text: str) -> str:
    return " ".join(text.lower().replace("-", " ").replace("_", " ").split())


def states(answer: object, text: str) -> str | None:
    """The words of ``text`` that state ``answer``, or None."""
    if isinstance(answer, str):
        words = _normal(answer)
        found = re.search(rf"(?<!\w){re.escape(words)}(?!\w)", _normal(text))
        return found.group(0) if found else None
    for token in _NUMERAL.finditer(text):
        if numeral_is(token, float(answer)):
            return token.group(0)
    if not common(answer):
        for a, b in _PRODUCT.findall(text):
            if int(a) * int(b) == answer:
                return f"{a} × {b}"
    return None


def _constant(node: ast.AST) -> Any:
    """The value of an expression made of literals only (``16 * 8``, ``[10, 80]``), else None."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if isinstance(node, (ast.BinOp, ast.UnaryOp)) and all(
        isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop))
        for n in ast.walk(node)
    ):
        try:
            return eval(compile(ast.Expression(node), "<constant>", "eval"), {"__builtins__": {}})  # noqa: S307
        except Exception:  # an overflow or a division by zero is no answer
            return None
    return None


def _is_answer(value: Any, answer: object) -> bool:
    if isinstance(answer, str):
        return isinstance(value, str) and _normal(value) == _normal(answer)
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_is_answer(v, answer) for v in value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isclose(value, float(answer), rel_tol=1e-3, abs_tol=1e-12)


def _prose_of(source: str, tree: ast.AST | None) -> str:
    """The prose a code cell's source holds: its comments and string literals (an f-string's
    text parts), what a reader reads as sentences; the whole source when it is not Python."""
    if tree is None:
        return source
    parts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    try:
        parts += [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
                  if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, IndentationError):
        pass
    return "\n".join(parts)


def code_states(answer: object, source: str) -> str | None:
    """What in a code cell's source gives ``answer`` away, or None: its prose (comments and
    strings) stating it, a comparison with it, or a constant expression whose value it is.
    A number used as data (``TinyGPT(n_embd=32)``, ``range(128)``) states nothing."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # IPython syntax (%magic): read it as text only
        tree = None
    if not common(answer):
        said = states(answer, _prose_of(source, tree))
        if said:
            return f"the text {said!r}"
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if isinstance(answer, str):
                    if any(isinstance(n, ast.Constant) and _is_answer(n.value, answer) for n in ast.walk(side)):
                        return f"a comparison naming {answer!r}: {ast.unparse(node)}"
                elif _is_answer(_constant(side), answer):
                    return f"a comparison with the answer: {ast.unparse(node)}"
        elif isinstance(node, (ast.BinOp, ast.UnaryOp)) and not isinstance(answer, str):
            if _is_answer(_constant(node), answer):
                return f"the expression {ast.unparse(node)}"
    return None


# --- a notebook as a list of what a learner reads ------------------------------------------


@dataclass
class Piece:
    """One thing a learner reads: a cell's Markdown (or its part before a heading), a code
    source, or one output."""

    cell: int
    kind: str  # "markdown", "code", "output"
    text: str


def _markdown_parts(text: str) -> tuple[str, str | None]:
    """A Markdown cell's text before its first heading line, and from that line on (None
    when it has no heading). Lines inside fenced code are not headings."""
    fenced, lines = False, text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and HEADING.match(line):
            return "".join(lines[:i]), "".join(lines[i:])
    return text, None


def _cells(notebook: dict) -> list[dict]:
    cells = notebook["cells"]
    for cell in cells:
        cell["source"] = _text(cell.get("source"))
    return cells


@dataclass
class Prediction:
    name: str  # exNN.name
    answer: object
    question: int  # the cell that calls check
    end: int  # the cell holding the next heading (len(cells) if none)


def predictions(cells: list[dict]) -> list[Prediction]:
    found = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        for module, name in CHECK.findall(cell["source"]):
            exercise = getattr(importlib.import_module(f"accumlab_course.exercises.{module}"), name)
            if exercise.kind != "prediction":
                continue
            end = next((j for j in range(i + 1, len(cells)) if cells[j]["cell_type"] == "markdown"
                        and _markdown_parts(cells[j]["source"])[1] is not None), len(cells))
            found.append(Prediction(f"{module}.{name}", exercise.answer, i, end))
    return found


def _section_start(cells: list[dict], before: int) -> int:
    """The cell holding the last heading above cell ``before`` (0 if none)."""
    return max((i for i in range(before) if cells[i]["cell_type"] == "markdown"
                and _markdown_parts(cells[i]["source"])[1] is not None), default=0)


def _pieces(cells: list[dict], start: int, stop: int, *, code: bool) -> list[Piece]:
    out = []
    for i in range(start, stop):
        cell = cells[i]
        if cell["cell_type"] == "markdown":
            out.append(Piece(i, "markdown", rendered(cell["source"])))
        elif cell["cell_type"] == "code":
            if code:
                out.append(Piece(i, "code", cell["source"]))
            out += [Piece(i, "output", visible_output(o)) for o in cell.get("outputs", [])]
    return out


def problems(cells: list[dict], where: str) -> list[str]:
    """Every place a learner meets a prediction's answer before acting on it, named by
    ``where`` (the notebook), the cell and the prediction."""
    out = []
    for p in predictions(cells):
        said = f"{where}, {p.name} (asked in cell {p.question})"
        reveal = re.compile(rf"\b{re.escape(p.name)}\.reveal\(")
        revealing = [j for j in range(p.question + 1, p.end)
                     if cells[j]["cell_type"] == "code" and reveal.search(cells[j]["source"])]
        if not revealing:
            out.append(f"{said}: no cell before the next heading calls {p.name}.reveal(value) to "
                       "show the answer folded")
        for j in revealing:
            if cells[j].get("metadata", {}).get("jupyter", {}).get("outputs_hidden"):
                out.append(f"{said}: cell {j} is saved with its outputs collapsed; Run All unfolds "
                           "them and the site folds the answer twice: save it unfolded")
            answers = [o for o in cells[j].get("outputs", []) if "accumlab-answer" in _text(
                o.get("data", {}).get("text/html"))]
            if not answers:
                out.append(f"{said}: cell {j} calls reveal but saved no folded answer; re-execute it")
        # the region: everything after the question up to the next heading
        region = [Piece(p.question, "code", cells[p.question]["source"])]
        region += _pieces(cells, p.question + 1, p.end, code=True)
        if p.end < len(cells):
            region.append(Piece(p.end, "markdown", rendered(_markdown_parts(cells[p.end]["source"])[0])))
        # above: from the top (a common answer: from the section's heading) to the question
        section = _section_start(cells, p.question)
        top = section if common(p.answer) else 0
        above = [q for q in _pieces(cells, top, p.question, code=False)]
        above += [q for q in _pieces(cells, section, p.question, code=True) if q.kind == "code"]
        if isinstance(p.answer, str):  # the question's own Markdown lists the choices
            asked = p.question - 1
            while asked >= 0 and cells[asked]["cell_type"] == "markdown":
                asked -= 1
            above = [q for q in above if not (q.kind == "markdown" and q.cell > asked)]
        for place, pieces in (("before its reveal is opened", region), ("above the question", above)):
            for piece in pieces:
                if piece.kind == "code":
                    found = code_states(p.answer, piece.text)
                else:
                    found = states(p.answer, piece.text)
                    found = found and repr(found)
                if found:
                    what = {"code": "the source", "markdown": "the Markdown",
                            "output": "an output"}[piece.kind]
                    out.append(f"{said}: {what} of cell {piece.cell} shows the answer {place}: {found}")
    return out


def _notebook(path: Path) -> list[dict]:
    return _cells(json.loads(path.read_text(encoding="utf-8")))


# --- the site's copy of a lesson -----------------------------------------------------------


@pytest.fixture(scope="module")
def site():
    """tools/build_site.py, to assemble each lesson as the site shows it (no Sphinx run)."""
    return importlib.import_module("build_site")


def site_lesson(site: Any, path: Path) -> tuple[list[dict], list[dict]]:
    """The lesson's cells as the site shows them, and its exercises as the index lists them."""
    pages = {f"notebooks/{p.name}": f"{site.LESSONS_DIR}/{p.name}" for p in NOTEBOOKS}
    pages.update(site.DOC_PAGES)
    pages.update({"accumlab/loop.py": site.LOOP_PAGE, "README.md": "index.md"})
    teaches = site.course_rows((REPO / "README.md").read_text(encoding="utf-8"))
    nb, exercises = site._lesson(path, pages, site.project_urls()["Repository"],
                                 teaches.get(path.stem, [""])[0])
    return _cells(nb), exercises


# --- the course's notebooks ----------------------------------------------------------------


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_prediction_is_answered_before_it_is_acted_on(path):
    assert problems(_notebook(path), path.name) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_nor_on_the_site(site, path):
    cells, exercises = site_lesson(site, path)
    found = problems(cells, f"{path.name} on the site")
    for exercise in exercises:
        module, name = exercise["path"].split(".")
        checker = getattr(importlib.import_module(f"accumlab_course.exercises.{module}"), name)
        # (a choice's line may list the choices, as its question does)
        if checker.kind == "prediction" and not isinstance(checker.answer, str):
            if states(checker.answer, exercise["practises"]):
                found.append(f"{path.name}: the exercise index says what {exercise['path']} practises "
                             f"with its answer: {exercise['practises']!r}")
    assert found == []


# --- the test itself, on notebooks written for it ------------------------------------------


def _md(text: str) -> dict:
    return {"cell_type": "markdown", "metadata": {}, "source": text}


def _code(text: str, *outputs: dict, hidden: bool = False) -> dict:
    metadata = {"jupyter": {"outputs_hidden": True}} if hidden else {}
    return {"cell_type": "code", "metadata": metadata, "source": text, "outputs": list(outputs),
            "execution_count": 1}


def _printed(text: str) -> dict:
    return {"output_type": "stream", "name": "stdout", "text": text}


def _revealed(name: str, shown: str) -> dict:
    """What ``reveal`` saves (tests/course/test_reveal.py checks the real one)."""
    summary = f"Answer to {name}: open it once your prediction is written"
    return {"output_type": "display_data", "metadata": {},
            "data": {"text/html": f'<details class="accumlab-answer"><summary>{summary}</summary>'
                                  f"<pre>{shown}</pre></details>",
                     "text/plain": f"{summary} (folded: open it in the notebook)"}}


# ex00.effective_batch's answer is 64, ex00.update_attempts's 3 (a common number),
# ex08.factor_predicted's 0.92233..., ex02.same_direction's 'positions counted' (a choice).
ASK = _code("effective_batch = ...\nex00.effective_batch.check(effective_batch)", _printed("○ not attempted yet"))
REVEAL = _code("ex00.effective_batch.reveal(table['effective'])", _revealed("ex00.effective_batch", "64"))


def _found(cells: list[dict]) -> list[str]:
    return problems(cells, "00_x.ipynb")


def test_a_well_made_prediction_passes():
    cells = [_md("# 00\n## 1. Sizes\nPredict first: the effective batch?"), ASK, REVEAL,
             _md("The table's numbers, then the next section.\n## 2. Next\nIt was 64.")]
    assert _found(cells) == []


@pytest.mark.parametrize(("cells", "found"), [
    # the ways, one by one
    ([_md("## 2\nPredict"), ASK, _code("ex00.effective_batch.reveal(x)  # 64 examples", _revealed("ex00.effective_batch", "64"))],
     "the source of cell 2 shows the answer before its reveal is opened: the text '64'"),
    ([_md("## 2\nPredict"), ASK, _code("ex00.effective_batch.reveal(x, shown=f'{x} = 64')", _revealed("ex00.effective_batch", "64"))],
     "the source of cell 2 shows the answer before its reveal is opened: the text '64'"),
    ([_md("## 2\nPredict"), ASK, _code("ex00.effective_batch.reveal(t)\nassert t == 16 * 4", _revealed("ex00.effective_batch", "64"))],
     "the source of cell 2"),
    ([_md("## 2\nPredict"), ASK, _code("ex00.effective_batch.reveal(t)", _printed("effective batch 64\n"),
                                       _revealed("ex00.effective_batch", "64"))],
     "an output of cell 2 shows the answer before its reveal is opened: '64'"),
    ([_md("## 2\nPredict"), ASK, REVEAL, _md("It is 64: m × A × D.")],
     "the Markdown of cell 3 shows the answer before its reveal is opened"),
    ([_md("## 2\nPredict"), ASK, REVEAL, _md("So 16 × 4 examples.\n## 3. Later\n")],
     "the Markdown of cell 3"),
    ([_md("## 2\nPredict"), ASK, REVEAL, _code("print(t)", _printed("examples per update: 64\n"))],
     "an output of cell 3"),
    ([_code("x", _printed("an update of 64 examples")), _md("## 2\nPredict"), ASK, REVEAL],
     "an output of cell 0 shows the answer above the question"),
    ([_md("With 64 examples per update ...\n## 2\nPredict"), ASK, REVEAL],
     "the Markdown of cell 0 shows the answer above the question"),
    ([_md("## 2\nPredict"), ASK, _code("print(t)", _printed("64"), hidden=True)],
     "no cell before the next heading calls ex00.effective_batch.reveal"),
    ([_md("## 2\nPredict"), ASK, _code("ex00.effective_batch.reveal(t)", _revealed("ex00.effective_batch", "64"),
                                       hidden=True)],
     "saved with its outputs collapsed"),
    ([_md("## 2\nPredict"), ASK, _code("ex00.effective_batch.reveal(t)")], "saved no folded answer"),
    ([_md("## 2\nPredict"), ASK, _code("ex00.effective_batch.reveal(t)", {
        "output_type": "display_data", "metadata": {},
        "data": {"text/html": '<details open class="accumlab-answer"><summary>s</summary>64</details>',
                 "text/plain": "s"}})], "an output of cell 2"),
    ([_md("## 2\nPredict"), ASK, _code("ex00.effective_batch.reveal(t)", {
        "output_type": "display_data", "metadata": {},
        "data": {"text/html": '<details class="accumlab-answer"><summary>it is 64</summary>64</details>',
                 "text/plain": "s"}})], "an output of cell 2"),
])
def test_each_way_of_giving_the_answer_away_is_found(cells, found):
    got = _found(cells)
    assert any(found in p for p in got), got
    assert all(p.startswith("00_x.ipynb, ex00.effective_batch (asked in cell ") for p in got)


def test_a_common_number_is_looked_for_above_in_its_own_section_only():
    ask = _code("update_attempts = ...\nex00.update_attempts.check(update_attempts)")
    reveal = _code("ex00.update_attempts.reveal(n)", _revealed("ex00.update_attempts", "3"))
    cells = [_md("## 1\nThree ranks, 3 GPUs."), _md("## 2\nPredict the attempts."), ask, reveal]
    assert _found(cells) == []
    cells[1] = _md("## 2\nThere are 3 windows. Predict the attempts.")
    assert any("Markdown of cell 1" in p for p in _found(cells))


def test_a_common_number_in_code_is_found_in_a_comparison_only():
    ask = _code("update_attempts = ...\nex00.update_attempts.check(update_attempts)")
    fine = _code("windows = list(plan.windows(batches[:3]))\nex00.update_attempts.reveal(len(windows))",
                 _revealed("ex00.update_attempts", "3"))
    assert _found([_md("## 2\nPredict"), ask, fine]) == []
    given = _code("ex00.update_attempts.reveal(n)\nassert n == 3", _revealed("ex00.update_attempts", "3"))
    assert any("a comparison with the answer: n == 3" in p for p in _found([_md("## 2"), ask, given]))


def test_a_choice_is_found_in_words_and_in_a_comparison_naming_it():
    ask = _code("same_direction = ...\nex02.same_direction.check(same_direction)")
    reveal = _code("ex02.same_direction.reveal(best)", _revealed("ex02.same_direction", "positions counted"))
    question = _md("## 3\nWhich keeps the direction: 'average of averages' or 'positions counted'?")
    assert _found([question, ask, reveal]) == []
    told = _code("ex02.same_direction.reveal(best)\nassert cosine(wrong['positions counted']) > 0.9995",
                 _revealed("ex02.same_direction", "positions counted"))
    assert any("a comparison naming 'positions counted'" in p for p in _found([question, ask, told]))
    printed = _code("ex02.same_direction.reveal(best)", _printed("positions counted: cosine 1.000"),
                    _revealed("ex02.same_direction", "positions counted"))
    assert any("an output of cell 2" in p for p in _found([question, ask, printed]))


def test_a_cell_with_prose_then_a_heading_ends_the_region_at_the_heading():
    cells = [_md("## 2\nPredict"), ASK, REVEAL, _md("Nothing here.\n## 3. Next\nThe batch was 64.")]
    assert _found(cells) == []
    cells[3] = _md("The batch was 64.\n## 3. Next\n")
    assert any("Markdown of cell 3" in p for p in _found(cells))


@pytest.mark.parametrize(("answer", "text", "found"), [
    (64, "164 targets, 6.4 s, 64.5 MB, v2.64.1", None),
    (64, "64 examples", "64"),
    (32, "checkpoint-00000032-rank0.pt", "00000032"),
    (10790, "10,790 targets", "10,790"),
    (0.9223300970873787, "applied = 0.9223 x reference", "0.9223"),
    (0.9223300970873787, "about 0.92 of it", None),  # two digits only: not a statement of it
    (0.9223300970873787, "0.922", "0.922"),
    (3.5, "a mean of 3.5 nats", "3.5"),
    (3.5, "3.50", "3.50"),
    (3.5, "35 or 3.6", None),
    (2.25, "0.251 and 10.25 and 2.2", None),
    (5.960464477539063e-08, "as fp16: 5.96e-08", "5.96e-08"),
    (1.0, "ratio 1.0000", "1.0000"),
    (128, "16 × 8 examples", "16 × 8"),
    ("average of averages", "the Average-of-averages model", "average of averages"),
])
def test_an_answer_is_recognised_as_written(answer, text, found):
    assert states(answer, text) == found


def test_closed_details_hide_their_body_and_open_ones_do_not():
    assert rendered('<details><summary>Answer</summary><pre>80</pre></details> after').split() == ["Answer", "after"]
    assert "80" in rendered('<details open><summary>Answer</summary><pre>80</pre></details>')
    assert "80" not in rendered('<details><summary>a</summary><details open><summary>b</summary>80</details></details>')
    assert rendered("x < 3 and y > 2") == "x < 3 and y > 2"


def test_a_number_used_as_data_in_code_states_nothing():
    assert code_states(32, "model = TinyGPT(VOCAB_SIZE, n_layer=2, n_embd=32)") is None
    assert code_states(32, "print('32 updates')") == "the text '32'"
    assert code_states(32, "n = 32  # the run's 32 updates") == "the text '32'"
    assert code_states(128, "assert seen == 16 * 8").startswith("a comparison with the answer")
