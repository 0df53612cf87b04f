"""`accumlab env` tells a standalone install to use pip, and a checkout to use `make lab`."""

from __future__ import annotations

import importlib.metadata

import pytest

from accumlab_course import environment


def _missing(name: str) -> str:
    raise importlib.metadata.PackageNotFoundError(name)


@pytest.mark.parametrize(("checkout", "says"), [(True, "`make lab` installs it"),
                                                 (False, "`pip install jupyterlab` installs it")])
def test_missing_jupyterlab_hint_fits_the_install(monkeypatch, checkout, says):
    real = importlib.metadata.version
    monkeypatch.setattr(environment.importlib.metadata, "version",
                        lambda d: _missing(d) if d == "jupyterlab" else real(d))
    monkeypatch.setattr(environment, "in_checkout", lambda: checkout)
    assert environment.environment()["jupyterlab"] == f"not installed ({says})"


def test_this_repository_is_a_checkout():
    assert environment.in_checkout()


def test_a_standalone_install_is_not_told_to_run_make(monkeypatch):
    monkeypatch.setattr(environment, "in_checkout", lambda: False)
    info = {**environment.environment(), "matplotlib": None, "gloo": True}
    monkeypatch.setattr(environment, "check_devices", lambda info: [])
    problems = environment.smoke_check(info)
    assert problems == ["matplotlib is missing; install it with `pip install matplotlib`"]
