"""Check a Lightning job's gradient accumulation: :class:`SplitInvarianceCallback`.

``L.Trainer(accumulate_grad_batches=A, callbacks=[SplitInvarianceCallback()])`` checks the
run's first window by split invariance (:mod:`accumlab.invariance`): the window's examples
replayed through the module's own ``training_step`` and Lightning's division by
``accumulate_grad_batches`` at other splits, and against the token mean when the module
returns a Hugging Face causal LM's ``.loss``. It never changes the run and never stops it.

An extra: ``pip install 'accumlab[lightning]'`` (``lightning>=2.4``, the ``lightning``
package's ``lightning.pytorch``); ``import accumlab`` never imports it. Tested with the
release in the lock (Lightning 2.6.6). One idea per module: :mod:`.replay` (the window
run again at a split, the engine's ``run``) and :mod:`.callback` (the callback).
"""

try:
    import lightning.pytorch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess without lightning
    raise ImportError(
        "accumlab.lightning needs Lightning: pip install 'accumlab[lightning]' (lightning>=2.4)"
    ) from exc

from .callback import AccumulationCheckWarning, SplitInvarianceCallback

__all__ = ["AccumulationCheckWarning", "SplitInvarianceCallback"]
