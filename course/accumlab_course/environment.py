"""Is this machine ready for the course? What ``accumlab env [--check]`` prints.

:func:`environment` gathers the versions, CPU threads and devices; :func:`smoke_check`
adds what the course needs (matplotlib, ipywidgets, gloo) and one accumulation window
against the full batch on every device (:func:`accumulation_check`). Every problem found
is a sentence saying what is wrong and what to do; a fix names ``make lab`` in the
course's repository and ``pip`` in a standalone install (:func:`in_checkout`).
"""

from __future__ import annotations

import importlib.metadata
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: The PyTorch release the course and its saved notebook outputs were made with.
TESTED_TORCH = "2.13"


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def in_checkout() -> bool:
    """Whether accumlab runs from the course's repository (its Makefile beside the package),
    so `make lab` exists; a standalone install (pip, a wheel) has no Makefile."""
    return (Path(__file__).resolve().parents[2] / "Makefile").is_file()


def environment() -> dict[str, Any]:
    """Versions, CPU threads and devices, as ``accumlab env`` prints them."""
    import torch

    cuda = torch.cuda.is_available()
    mps = getattr(torch.backends, "mps", None)
    hint = "`make lab` installs it" if in_checkout() else "`pip install jupyterlab` installs it"
    return {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "torch": torch.__version__,
        "accumlab": _version("accumlab") or "not installed (run from a checkout)",
        "threads": torch.get_num_threads(),
        "cuda": cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "mps": bool(mps is not None and mps.is_available()),
        "distributed": torch.distributed.is_available(),
        "gloo": torch.distributed.is_available() and torch.distributed.is_gloo_available(),
        "matplotlib": _version("matplotlib"),
        "ipywidgets": _version("ipywidgets"),
        "jupyterlab": _version("jupyterlab") or f"not installed ({hint})",
    }


def check_devices(info: dict[str, Any]) -> list[str]:
    """The devices the smoke check runs on: ``cpu``, then each CUDA GPU, then ``mps``."""
    devices = ["cpu"] + [f"cuda:{i}" for i in range(len(info["gpus"]))]
    return devices + (["mps"] if info["mps"] else [])


def accumulation_check(device: str, splits: Sequence[int] = (2, 1, 3)) -> tuple[float, float]:
    """One accumulation window against the full batch on ``device``.

    A 1-layer tiny GPT (seeded) on the first ``sum(splits)`` examples of the shipped data
    set: the gradient of the full batch against the one accumulated over microbatches of
    ``splits`` examples. Returns ``(max relative error, tolerance)``; the tolerance is
    1e-5 on the CPU and 1e-4 on accelerators, whose kernels may reorder float sums.
    """
    import torch

    from accumlab import checks
    from accumlab.objectives import NextTokenLoss

    from . import data
    from .models import TinyGPT

    examples = data.load_examples(limit=sum(splits))
    batch = {key: value.to(device) for key, value in data.collate(examples).items()}
    torch.manual_seed(0)
    model = TinyGPT(data.VOCAB_SIZE, n_layer=1, n_head=2, n_embd=32).to(device)
    comparison = checks.compare_gradients(model, batch, NextTokenLoss(), splits=list(splits))
    return comparison.max_rel_error, (1e-5 if device == "cpu" else 1e-4)


def smoke_check(info: dict[str, Any]) -> list[str]:
    """The checks of ``accumlab env --check``, printing one line per device checked.
    Returns the problems found (empty when everything passed)."""
    problems = []
    for name in ("matplotlib", "ipywidgets"):
        if info[name] is None:
            fix = "`pip install -e .` (or `make lab`)" if in_checkout() else f"`pip install {name}`"
            problems.append(f"{name} is missing; install it with {fix}")
    if not info["gloo"]:
        problems.append("torch.distributed with gloo is unavailable; notebook 04 needs it")
    if not str(info["torch"]).startswith(TESTED_TORCH + "."):
        print(f"note: the course was made with torch {TESTED_TORCH}; other versions may print "
              "slightly different numbers")
    for device in check_devices(info):
        try:
            error, tolerance = accumulation_check(device)
        except Exception as exc:  # any failure here is the finding to report
            problems.append(f"the accumulation check on {device} raised {type(exc).__name__}: {exc}")
            continue
        verdict = "ok" if error <= tolerance else "FAILED"
        print(f"accumulation window on {device}: microbatches of 2+1+3 examples vs the full "
              f"batch of 6: max relative gradient error {error:.1e} (tolerance {tolerance:.0e}) "
              f"{verdict}")
        if error > tolerance:
            problems.append(f"on {device} the accumulated gradient differs from the full "
                            f"batch by {error:.1e} (relative), above {tolerance:.0e}")
    return problems
