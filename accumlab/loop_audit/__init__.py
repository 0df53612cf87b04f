"""The audit of a user's window loop: run it on a controlled set whose correct updates are
known, and name what differs. Its one public name is :func:`accumlab.audit` (with its
:class:`~accumlab.AuditReport`); the mistakes it names are in the table both audits share,
:mod:`accumlab.mistakes`.

``audit(train_one_window)`` gives the loop a tiny float64 causal language model, an SGD
optimizer, a constant scheduler and four windows of microbatches, traces every forward
pass, backward pass, ``zero_grad``, ``optimizer.step``, ``scheduler.step`` and clip, and
writes the gradient each ``optimizer.step`` found as a combination of the correct
per-example contributions (each example's summed next-token loss over its window's target
count, at the weights its forward pass ran at). The shares of that combination name the
mistake: all ``1/A`` is a double division, ``1/targets of the microbatch`` an average of
averages, 0 for an example never trained a lost microbatch, 2 for one trained twice a
duplicated microbatch, and so on. Everything is float64, so a correct loop matches to
about 1e-12 and the verdict's tolerance, ``AUDIT_TOLERANCE``, is 1e-6 relative.

One idea per module, each importing only the ones listed before it:

- :mod:`.controlled_set`: the windows whose correct updates are known, the audit's model
  (``AuditLM``) and the examples' counts (``Row``);
- :mod:`.trace`: ``UpdateTrace``, the hooks that record what the loop's updates were made
  of, in order;
- :mod:`.contributions`: each example's correct contribution at given weights;
- :mod:`.shares`: each update as a combination of contributions (the shared
  :func:`accumlab.least_squares.least_squares`);
- :mod:`.weightings`: what a loop can divide each loss sum by, and the mistakes each stands
  for;
- :mod:`.report`: ``AuditReport``, ``WindowAudit`` and the printed text;
- :mod:`.window`: one window's measurements and the mistakes they show on their own;
- :mod:`.evidence` and :mod:`.kept`: the sentence each name quotes; the tensors a loop
  kept alive;
- :mod:`.verdict`: every window turned into the report;
- :mod:`.run`: ``audit``, which runs the user's loop and returns the report.
"""
