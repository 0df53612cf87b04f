"""Re-execute notebooks in place, the way `pytest --nbval` will run them.

nbval starts a plain kernel and does not emulate Output widgets, so this runner does the
same: no Output-widget capture, file-descriptor capture off (prints from spawned worker
processes must not land in saved outputs), a fresh kernel per notebook, cells run in
order from the notebook's own folder.

A widget is saved as its drawing (:func:`save_widgets_drawn`): an output that carries both a
live widget view and a ``text/html`` form (the course's explorers,
``accumlab_course.widgets``) keeps the ``text/html`` only, and the notebook keeps no widget
state when no live view is left. JupyterLab restores saved widget state without a kernel
behind it and marks every part of such a widget with a red "disconnected" icon; the drawing
shows the widget at its settings instead, until the cell runs. nbval never compares the
widget view (its model id is random), so the saved file still passes strict nbval.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def nbval_client(
    nb: nbformat.NotebookNode, path: Path, timeout: int = 900, allow_errors: bool = False
) -> NotebookClient:
    """A client that executes ``nb`` (read from ``path``) the way nbval runs it."""
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        extra_arguments=["--IPKernelApp.capture_fd_output=False"],
        record_timing=False,
        allow_errors=allow_errors,
    )
    client.widget_registry = {}  # nbval does not emulate Output widgets; neither do we
    return client


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def save_widgets_drawn(nb: nbformat.NotebookNode) -> int:
    """Drop the live widget view of every output that also has a ``text/html`` drawing,
    and the notebook's saved widget state once no live view is left; returns how many
    views were dropped. A view without a drawing keeps the state it needs."""
    dropped, left = 0, 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if WIDGET_VIEW in data and "text/html" in data:
                del data[WIDGET_VIEW]
                dropped += 1
            elif WIDGET_VIEW in data:
                left += 1
    if not left:
        nb.metadata.pop("widgets", None)
    return dropped


def run(path: Path, timeout: int = 900) -> float:
    nb = nbformat.read(path, as_version=4)
    client = nbval_client(nb, path, timeout)
    start = time.perf_counter()
    client.execute()
    save_widgets_drawn(nb)
    # Save the kernel under the name ipykernel installs, so JupyterLab opening the notebook
    # finds nothing to update and leaves the committed file as it is.
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nbformat.write(nb, path)
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    paths = [Path(p) for p in argv] or sorted(Path("notebooks").glob("[0-9]*.ipynb"))
    for path in paths:
        seconds = run(path)
        print(f"{path}: executed and saved in {seconds:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
