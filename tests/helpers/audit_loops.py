"""A corpus of user window loops for ``al.audit``, correct and buggy, in different styles.

Every loop is a user's ``train_one_window(model, optimizer, scheduler, window)``.
``EXPECTED[loop]`` is the exact verdict: ``OK`` for a correct loop, else the exact set of
mistake names and whether findings outside the vocabulary (``report.other``) are expected.
Styles: manual shifted cross-entropy with ``reduction="sum"``, Hugging Face ``labels=``
(the model's own ``.loss``) with or without ``num_items_in_batch``, per-token losses,
per-row loops, one forward for the whole window, no-grad or eval-mode forwards for
logging, and the classic symptoms of the course (double division, average of averages,
ignored tokens, misplaced ``zero_grad``/``step``, kept references, scheduler per
microbatch), plus lost, duplicated and misaligned data.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# -- helpers a user would write ----------------------------------------------------------


def targets(window):
    """Supervised targets of the window: labels after the shift, -100 excluded."""
    return sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in window)


def logits_of(model, mb):
    return model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits


def shifted_sum(logits, labels):
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)),
        labels[:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


def loss_sum(model, mb):
    return shifted_sum(logits_of(model, mb), mb["labels"])


def mean_loss(model, mb):
    logits = logits_of(model, mb)
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), mb["labels"][:, 1:].reshape(-1)
    )


def rows_of(mb):
    """Each row of a microbatch as its own microbatch of one example, padding kept."""
    return [{k: v[r : r + 1] for k, v in mb.items()} for r in range(mb["input_ids"].shape[0])]


def trimmed_rows_of(mb):
    """Each row of a microbatch as its own microbatch of one example, padding removed."""
    out = []
    for r in range(mb["input_ids"].shape[0]):
        n = int(mb["attention_mask"][r].sum())
        out.append({k: v[r : r + 1, :n] for k, v in mb.items()})
    return out


LOG: list = []  # a user's log; report_of clears it around every audit
_REPORTS: dict = {}


def report_of(loop):
    """``al.audit(loop)``, once per test session (shared by every audit test file)."""
    if loop not in _REPORTS:
        import accumlab as al

        LOG.clear()
        _REPORTS[loop] = al.audit(loop)
        LOG.clear()
    return _REPORTS[loop]


def flat(text: str) -> str:
    """``text`` with each run of whitespace one space: a printed report wraps its lines."""
    return " ".join(text.split())


@dataclass(frozen=True)
class Expect:
    mistakes: frozenset[str] = frozenset()
    other: bool = False  # findings outside the vocabulary expected

    @property
    def ok(self) -> bool:
        return not self.mistakes and not self.other


OK = Expect()


def bad(*names: str, other: bool = False) -> Expect:
    return Expect(frozenset(names), other)


# -- correct loops -----------------------------------------------------------------------


def plain(model, optimizer, scheduler, window):
    optimizer.zero_grad(set_to_none=True)
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def no_sync_style(model, optimizer, scheduler, window):
    total = targets(window)
    for i, mb in enumerate(window):
        sync = i == len(window) - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if sync else model.no_sync():
            (loss_sum(model, mb) / total).backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)  # cleared after the step, ready for the next window
    scheduler.step()


def per_token_losses(model, optimizer, scheduler, window):
    optimizer.zero_grad(set_to_none=False)  # zeroed gradient tensors live on: not a leak
    total = sum(int(mb["labels"][:, 1:].ne(-100).sum()) for mb in window)
    logged = 0.0
    for mb in window:
        logits = model(**{k: v for k, v in mb.items() if k != "labels"}).logits
        per_token = F.cross_entropy(
            logits[:, :-1].transpose(1, 2), mb["labels"][:, 1:], reduction="none"
        )  # 0 at ignored positions
        part = per_token.sum()
        (part / total).backward()
        logged += part.item()
        del logits, per_token, part
    optimizer.step()
    scheduler.step()
    return logged / total


def hf_num_items(model, optimizer, scheduler, window):
    """Hugging Face style: the model's .loss, a sum over num_items_in_batch."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        model(**mb, num_items_in_batch=total).loss.backward()
    optimizer.step()
    scheduler.step()


def hf_num_items_tensor(model, optimizer, scheduler, window):
    """num_items_in_batch as a tensor, counted with the same shift the model applies."""
    optimizer.zero_grad()
    total = torch.stack([(mb["labels"][..., 1:] != -100).sum() for mb in window]).sum()
    for mb in window:
        out = model(input_ids=mb["input_ids"], labels=mb["labels"], num_items_in_batch=total)
        out.loss.backward()
    optimizer.step()
    scheduler.step()


def hf_mean_times_count(model, optimizer, scheduler, window):
    """The model's per-microbatch mean times its target count: a sum again."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        n = int((mb["labels"][:, 1:] != -100).sum())
        (model(**mb).loss * n / total).backward()
    optimizer.step()
    scheduler.step()


def per_row(model, optimizer, scheduler, window):
    """One row at a time (a microbatch of one example), padding kept."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        for row in rows_of(mb):
            (loss_sum(model, row) / total).backward()
    optimizer.step()
    scheduler.step()


def per_row_trimmed(model, optimizer, scheduler, window):
    """One row at a time, each cut to its attention mask (no padding at all)."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        for row in trimmed_rows_of(mb):
            model(**row, num_items_in_batch=total).loss.backward()
    optimizer.step()
    scheduler.step()


def whole_window_in_one_forward(model, optimizer, scheduler, window):
    """All microbatches padded to one width and run as one forward pass."""
    optimizer.zero_grad()
    width = max(mb["input_ids"].shape[1] for mb in window)

    def pad(t, value):
        return F.pad(t, (0, width - t.shape[1]), value=value)

    ids = torch.cat([pad(mb["input_ids"], 0) for mb in window])
    labels = torch.cat([pad(mb["labels"], -100) for mb in window])
    (shifted_sum(model(input_ids=ids).logits, labels) / targets(window)).backward()
    optimizer.step()
    scheduler.step()


def logs_no_grad_loss_first(model, optimizer, scheduler, window):
    """Logs each microbatch's loss under no_grad before training on it."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        with torch.no_grad():
            LOG.append(loss_sum(model, mb).item())
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def eval_forward_first(model, optimizer, scheduler, window):
    """An eval-mode, no-grad pass over the whole window before training on it."""
    model.eval()
    with torch.no_grad():
        LOG.append(sum(loss_sum(model, mb).item() for mb in window))
    model.train()
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def forward_without_backward_first(model, optimizer, scheduler, window):
    """A forward pass with autograd on whose graph is dropped unused (only .item())."""
    LOG.append(loss_sum(model, window[0]).item())
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def evaluates_after_step(model, optimizer, scheduler, window):
    """Logs the loss at the new weights, after the update, without a graph."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()
    with torch.no_grad():
        LOG.append(sum(loss_sum(model, mb).item() for mb in window) / total)


def detached_logging(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        part = loss_sum(model, mb)
        (part / total).backward()
        LOG.append(part.detach())  # a 0-d tensor without a graph
    optimizer.step()
    scheduler.step()


def shifted_copy_of_labels(model, optimizer, scheduler, window):
    """Shifts a copy of the labels (never the window's own tensor), then CE over all
    positions: the same loss as the shifted one."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        labels = mb["labels"].clone()
        labels[:, :-1] = mb["labels"][:, 1:]
        labels[:, -1] = -100
        logits = logits_of(model, mb)
        loss = F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        (loss / total).backward()
    optimizer.step()
    scheduler.step()


def one_backward_for_window(model, optimizer, scheduler, window):
    """Sums the window's losses into one tensor and calls backward once."""
    optimizer.zero_grad()
    total = targets(window)
    (sum(loss_sum(model, mb) for mb in window) / total).backward()
    optimizer.step()
    scheduler.step()


def autograd_grad_accumulated(model, optimizer, scheduler, window):
    """torch.autograd.grad per microbatch, added into .grad by hand."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    total = targets(window)
    for mb in window:
        grads = torch.autograd.grad(loss_sum(model, mb) / total, params)
        for p, g in zip(params, grads, strict=True):
            p.grad += g
    optimizer.step()
    scheduler.step()


def clips_every_microbatch_above_the_norm(model, optimizer, scheduler, window):
    """Clipping after every backward pass with a threshold it never reaches changes nothing."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
    optimizer.step()
    scheduler.step()


def clip_above_the_norm(model, optimizer, scheduler, window):
    """Clipping the combined gradient with a threshold it never reaches changes nothing."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
    optimizer.step()
    scheduler.step()


def shuffled_rows(model, optimizer, scheduler, window):
    """Microbatches in reverse order, the rows of each permuted."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in reversed(window):
        order = torch.arange(mb["input_ids"].shape[0]).flip(0)
        (loss_sum(model, {k: v[order] for k, v in mb.items()}) / total).backward()
    optimizer.step()
    scheduler.step()


def pairs_with_the_odd_one(model, optimizer, scheduler, window):
    """Two microbatches per backward pass, the last one alone when the count is odd."""
    optimizer.zero_grad()
    total = targets(window)
    for i in range(0, len(window), 2):
        sum(loss_sum(model, mb) for mb in window[i : i + 2]).div(total).backward()
    optimizer.step()
    scheduler.step()


def counts_after_the_shift_with_first_targets(model, optimizer, scheduler, window):
    """Counts every label, then removes each row's first one: the same count as the shift."""
    optimizer.zero_grad()
    total = sum(
        int((mb["labels"] != -100).sum() - (mb["labels"][:, 0] != -100).sum()) for mb in window
    )
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


SCALER = torch.amp.GradScaler("cpu")


def with_grad_scaler(model, optimizer, scheduler, window):
    """A GradScaler: scaled backward passes, unscaled before the one optimizer.step."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        SCALER.scale(loss_sum(model, mb) / total).backward()
    SCALER.step(optimizer)
    SCALER.update()
    scheduler.step()


CACHE: dict = {}


def makes_a_cache_once(model, optimizer, scheduler, window):
    """A buffer made in the first window and reused: not a leak."""
    if "causal" not in CACHE:
        CACHE["causal"] = torch.ones(16, 16, dtype=torch.bool).tril()
    plain(model, optimizer, scheduler, window)


LAST: dict = {}


def keeps_only_the_latest_logits(model, optimizer, scheduler, window):
    """Keeps the latest logits for a progress display, overwritten each microbatch."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        logits = logits_of(model, mb)
        (shifted_sum(logits, mb["labels"]) / total).backward()
        LAST["logits"] = logits.detach()
    optimizer.step()
    scheduler.step()


def lightning_automatic(training_step):
    """Lightning's automatic optimization written out, with ``accumulate_grad_batches =
    LIGHTNING_A``: each microbatch's ``training_step`` and backward run in a closure (the
    loss divided by the configured A, the gradients cleared before the window's first
    backward pass); the window's last closure runs inside ``optimizer.step(closure)``."""

    def train_one_window(model, optimizer, scheduler, window):
        def closure_for(i, mb):
            def closure():
                loss = training_step(model, mb, window) / LIGHTNING_A
                if i == 0:
                    optimizer.zero_grad()
                loss.backward()
                return loss

            return closure

        for i, mb in enumerate(window):
            if i < len(window) - 1:
                closure_for(i, mb)()
            else:
                optimizer.step(closure=closure_for(i, mb))
        scheduler.step()

    return train_one_window


LIGHTNING_A = 4
#: A token-sum module: its loss sum over the window's targets, times the A Lightning divides by.
lightning_token_sum = lightning_automatic(
    lambda model, mb, window: loss_sum(model, mb) / targets(window) * LIGHTNING_A
)
lightning_token_sum.__name__ = "lightning_token_sum"


def torchtitan_train_step(model, optimizer, scheduler, window):
    """torchtitan's train step: the window's valid tokens counted (over all ranks) before
    the forward passes, each microbatch's summed loss divided by them."""
    optimizer.zero_grad()
    global_valid_tokens = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in window)
    for mb in window:
        pred = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        loss = shifted_sum(pred, mb["labels"]) / global_valid_tokens
        del pred
        loss.backward()
    optimizer.step()
    scheduler.step()


def whole_window_in_a_closure(model, optimizer, scheduler, window):
    """The window's forward and backward passes inside the closure ``optimizer.step`` runs
    (as an LBFGS loop writes it)."""

    def closure():
        optimizer.zero_grad()
        total = targets(window)
        for mb in window:
            (loss_sum(model, mb) / total).backward()

    optimizer.step(closure)
    scheduler.step()


# -- one mistake each --------------------------------------------------------------------


def double_division(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total / len(window)).backward()
    optimizer.step()
    scheduler.step()


def hf_num_items_over_a(model, optimizer, scheduler, window):
    """num_items_in_batch already normalizes; the extra / A divides twice."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (model(**mb, num_items_in_batch=total).loss / len(window)).backward()
    optimizer.step()
    scheduler.step()


def average_of_averages(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    for mb in window:
        (mean_loss(model, mb) / len(window)).backward()
    optimizer.step()
    scheduler.step()


def hf_loss_over_a(model, optimizer, scheduler, window):
    """The model's own per-microbatch mean, divided by A: the average of averages again."""
    optimizer.zero_grad()
    for mb in window:
        (model(**mb).loss / len(window)).backward()
    optimizer.step()
    scheduler.step()


def per_row_means(model, optimizer, scheduler, window):
    """Each example's mean loss, averaged over the window's examples."""
    optimizer.zero_grad()
    rows = sum(mb["input_ids"].shape[0] for mb in window)
    for mb in window:
        for row in rows_of(mb):
            (model(**row).loss / rows).backward()
    optimizer.step()
    scheduler.step()


def ignored_tokens_counted(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = sum(mb["labels"][:, 1:].numel() for mb in window)  # -100 positions included
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def mask_counted(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = sum(int(mb["attention_mask"].sum()) for mb in window)  # prompt tokens included
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def zero_grad_in_window(model, optimizer, scheduler, window):
    total = targets(window)
    for mb in window:
        optimizer.zero_grad()
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def grads_dropped_by_hand(model, optimizer, scheduler, window):
    total = targets(window)
    for mb in window:
        for p in model.parameters():
            p.grad = None  # no zero_grad call to see: only the measured weights tell
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def no_update(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    scheduler.step()


def step_per_microbatch(model, optimizer, scheduler, window):
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
        optimizer.step()
        optimizer.zero_grad()
    scheduler.step()


def scheduler_per_microbatch(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
        scheduler.step()
    optimizer.step()


def kept_losses(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        loss = loss_sum(model, mb) / total
        loss.backward()
        LOG.append(loss)  # the log keeps the tensor and its graph, window after window
    optimizer.step()
    scheduler.step()


def kept_logits(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        logits = logits_of(model, mb)
        LOG.append(logits.detach())  # no graph, but the activations stay
        (shifted_sum(logits, mb["labels"]) / total).backward()
    optimizer.step()
    scheduler.step()


def counts_before_shift(model, optimizer, scheduler, window):
    """Counts the labels before the shift: a row whose first label is a target adds one
    count that no prediction scores."""
    optimizer.zero_grad()
    total = sum(int((mb["labels"] != -100).sum()) for mb in window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def hf_num_items_before_shift(model, optimizer, scheduler, window):
    """num_items_in_batch counted over the unshifted labels, as a trainer that does not
    know the model shifts them would."""
    optimizer.zero_grad()
    total = torch.stack([(mb["labels"] != -100).sum() for mb in window]).sum()
    for mb in window:
        model(**mb, num_items_in_batch=total).loss.backward()
    optimizer.step()
    scheduler.step()


def mask_minus_one_per_row(model, optimizer, scheduler, window):
    """Attention-mask tokens minus one per row: shifted, but the prompt still counted."""
    optimizer.zero_grad()
    total = sum(int((mb["attention_mask"].sum(dim=1) - 1).sum()) for mb in window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def mean_weighted_by_examples(model, optimizer, scheduler, window):
    """Each microbatch's mean weighted by its share of the window's examples."""
    optimizer.zero_grad()
    n = sum(mb["input_ids"].shape[0] for mb in window)
    for mb in window:
        (mean_loss(model, mb) * mb["input_ids"].shape[0] / n).backward()
    optimizer.step()
    scheduler.step()


def scheduler_before_step(model, optimizer, scheduler, window):
    """The scheduler advances before the update it belongs to (WORKSHOP's mystery_c)."""
    total = targets(window)
    optimizer.zero_grad()
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    scheduler.step()
    optimizer.step()


def scheduler_at_window_start(model, optimizer, scheduler, window):
    """The scheduler stepped first thing in every window: each update one schedule early."""
    scheduler.step()
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()


def clips_every_microbatch(model, optimizer, scheduler, window):
    """Clips after every backward pass: each clip shrinks a partial sum, and the earlier
    microbatches again at every later clip (their weights fall to ~1e-9)."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    optimizer.step()
    scheduler.step()


def clips_every_microbatch_mildly(model, optimizer, scheduler, window):
    """The same with a threshold a partial sum only sometimes passes."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)
    optimizer.step()
    scheduler.step()


def clips_before_each_backward(model, optimizer, scheduler, window):
    """Clips the gradient accumulated so far before each microbatch's backward pass."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        loss = loss_sum(model, mb) / total
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        loss.backward()
    optimizer.step()
    scheduler.step()


def clips_values_every_microbatch(model, optimizer, scheduler, window):
    """clip_grad_value_ after every backward pass: each entry clamped on partial sums."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    optimizer.step()
    scheduler.step()


#: The mean-loss module: ``return self.model(**batch).loss``, divided by Lightning's A.
lightning_mean = lightning_automatic(lambda model, mb, window: model(**mb).loss)
lightning_mean.__name__ = "lightning_mean"


def lightning_mean_per_window_a(model, optimizer, scheduler, window):
    """The mean-loss module with each window's own A (the audit's last window is short):
    an average of averages and nothing else."""
    per_window = lightning_automatic(lambda model, mb, w: model(**mb).loss * LIGHTNING_A / len(w))
    per_window(model, optimizer, scheduler, window)


def torchtune_single_device(model, optimizer, scheduler, window):
    """torchtune's single-device recipe: the window's labels counted before the shift,
    each microbatch's mean loss times its count, then scale_grads(1 / num_tokens)."""
    num_tokens = 0
    for mb in window:
        current = (mb["labels"] != -100).sum()
        num_tokens += current
        (model(**mb).loss * current).backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(1 / num_tokens)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


# -- lost, duplicated and misaligned data -------------------------------------------------


def skips_first(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    for mb in window[1:]:  # off by one: microbatch 0 never trains
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def all_but_last(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    part = window[:-1]
    total = targets(part)  # normalized over what it trains, but the last microbatch is lost
    for mb in part:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def pops_microbatches(model, optimizer, scheduler, window):
    """Pops from the list while iterating over it: every other microbatch is skipped."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
        window.pop(0)
    optimizer.step()
    scheduler.step()


def first_popped_for_logging(model, optimizer, scheduler, window):
    """The first microbatch is popped to log a loss and never trained."""
    optimizer.zero_grad()
    first = window.pop(0)
    with torch.no_grad():
        LOG.append(mean_loss(model, first).item())
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def only_last_microbatch(model, optimizer, scheduler, window):
    """The loop body is outside the for loop: only the last microbatch trains."""
    optimizer.zero_grad()
    for mb in window:  # noqa: B007  (the body below was meant to be inside)
        pass
    model(**mb).loss.backward()
    optimizer.step()
    scheduler.step()


def only_last_over_window_targets(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    mb = window[-1]
    (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def drops_last_row(model, optimizer, scheduler, window):
    """Slices one row too few out of every microbatch."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        n = mb["input_ids"].shape[0]
        part = {k: v[: max(n - 1, 1)] for k, v in mb.items()}
        (loss_sum(model, part) / total).backward()
    optimizer.step()
    scheduler.step()


def forgot_backward(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        loss = loss_sum(model, mb) / total
        LOG.append(loss.item())  # logged, never backpropagated
    optimizer.step()
    scheduler.step()


def truncates_rows(model, optimizer, scheduler, window):
    """Cuts every sequence to 6 tokens: the longer examples lose their later targets."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, {k: v[:, :6] for k, v in mb.items()}) / total).backward()
    optimizer.step()
    scheduler.step()


def steps_before_last_microbatch(model, optimizer, scheduler, window):
    """Off by one: the update is made before the window's last backward pass."""
    optimizer.zero_grad()
    total = targets(window)
    for i, mb in enumerate(window):
        (loss_sum(model, mb) / total).backward()
        if i == len(window) - 2:
            optimizer.step()
            scheduler.step()


def steps_first(model, optimizer, scheduler, window):
    """optimizer.step() at the top of the window: it applies the previous window's
    gradient, and this window's reaches no update of its own."""
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()


def pairs_microbatches(model, optimizer, scheduler, window):
    """Two microbatches per backward pass, zip(window[0::2], window[1::2]): the last one
    of a window with an odd count is dropped."""
    optimizer.zero_grad()
    total = targets(window)
    for a, b in zip(window[0::2], window[1::2]):  # noqa: B905 (the mistake under test)
        ((loss_sum(model, a) + loss_sum(model, b)) / total).backward()
    optimizer.step()
    scheduler.step()


def first_microbatch_twice(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    for mb in [*window, window[0]]:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def window_twice(model, optimizer, scheduler, window):
    """Two passes over the window before one update."""
    optimizer.zero_grad()
    total = targets(window)
    for _ in range(2):
        for mb in window:
            (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def labels_not_shifted(model, optimizer, scheduler, window):
    """Cross-entropy of every position against its own token."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        logits = logits_of(model, mb)
        loss = F.cross_entropy(
            logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100, reduction="sum"
        )
        (loss / total).backward()
    optimizer.step()
    scheduler.step()


def hf_labels_not_shifted_mean(model, optimizer, scheduler, window):
    """No shift, the mean over each microbatch's positions / A."""
    optimizer.zero_grad()
    for mb in window:
        logits = logits_of(model, mb)
        (F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten()) / len(window)).backward()
    optimizer.step()
    scheduler.step()


def shifts_in_place_then_hf(model, optimizer, scheduler, window):
    """Shifts the window's labels in place, then lets the model shift them again."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        labels = mb["labels"]
        labels[:, :-1] = labels[:, 1:].clone()
        labels[:, -1] = -100
        model(**mb, num_items_in_batch=total).loss.backward()
    optimizer.step()
    scheduler.step()


def shifts_in_place(model, optimizer, scheduler, window):
    """The right loss, but the window's labels are shifted in place: a data set that is
    read again (the next epoch, a retried window) is shifted once more."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        labels = mb["labels"]
        labels[:, :-1] = labels[:, 1:].clone()
        labels[:, -1] = -100
        logits = logits_of(model, mb)
        loss = F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        (loss / total).backward()
    optimizer.step()
    scheduler.step()


# -- outside the vocabulary ----------------------------------------------------------------


def never_cleared(model, optimizer, scheduler, window):
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def undivided(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    for mb in window:
        loss_sum(model, mb).backward()
    optimizer.step()
    scheduler.step()


def without_scheduler(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    optimizer.step()


def scheduler_every_other_window(model, optimizer, scheduler, window):
    """The schedule advances on every other update only."""
    LOG.append("window")
    without_scheduler(model, optimizer, scheduler, window)
    if len(LOG) % 2:
        scheduler.step()


def clipped_below_the_norm(model, optimizer, scheduler, window):
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    optimizer.step()
    scheduler.step()


def doubled_loss(model, optimizer, scheduler, window):
    """Every contribution twice as large, with one backward pass each: no named mistake."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (2 * loss_sum(model, mb) / total).backward()
    optimizer.step()
    scheduler.step()


def divides_by_examples(model, optimizer, scheduler, window):
    """Divides token-loss sums by the window's examples: no named weighting."""
    optimizer.zero_grad()
    rows = sum(mb["input_ids"].shape[0] for mb in window)
    for mb in window:
        (loss_sum(model, mb) / rows).backward()
    optimizer.step()
    scheduler.step()


# -- combinations --------------------------------------------------------------------------


def clips_and_steps_the_scheduler_per_microbatch(model, optimizer, scheduler, window):
    """Clip and scheduler.step() after every backward pass."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        scheduler.step()
    optimizer.step()


def clips_every_microbatch_over_a(model, optimizer, scheduler, window):
    """Clips after every backward pass and divides by A once more: the clip is named; the
    division is read (and named) once the clip is fixed."""
    optimizer.zero_grad()
    total = targets(window)
    for mb in window:
        (loss_sum(model, mb) / total / len(window)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    optimizer.step()
    scheduler.step()


def clinic_classic(model, optimizer, scheduler, window):
    """zero_grad, mean / A and the scheduler all inside the microbatch loop."""
    for mb in window:
        optimizer.zero_grad()
        (mean_loss(model, mb) / len(window)).backward()
        scheduler.step()
    optimizer.step()


def every_microbatch(model, optimizer, scheduler, window):
    """A loop without accumulation that still divides by A."""
    total = targets(window)
    for mb in window:
        optimizer.zero_grad()
        (loss_sum(model, mb) / total / len(window)).backward()
        optimizer.step()
        scheduler.step()


def mean_over_positions(model, optimizer, scheduler, window):
    """Mean over every position (ignored ones as zeros), per microbatch, / A twice."""
    optimizer.zero_grad()
    for mb in window:
        logits = logits_of(model, mb)
        per = F.cross_entropy(logits[:, :-1].transpose(1, 2), mb["labels"][:, 1:], reduction="none")
        (per.mean() / len(window) / len(window)).backward()
    optimizer.step()
    scheduler.step()


def forgot_step_and_kept(model, optimizer, scheduler, window):
    for mb in window:
        loss = mean_loss(model, mb)
        loss.backward()
        LOG.append(loss)
    scheduler.step()


def review_window(model, optimizer, scheduler, window):
    """Notebook 07's review loop: four mistakes at once."""
    for mb in window:
        optimizer.zero_grad()
        loss = model(**mb).loss / len(window)
        loss.backward()
        LOG.append(loss)
        scheduler.step()
    optimizer.step()


def skips_first_mean_over_a(model, optimizer, scheduler, window):
    """Loses microbatch 0 and averages the microbatch means."""
    optimizer.zero_grad()
    for mb in window[1:]:
        (mean_loss(model, mb) / len(window)).backward()
    optimizer.step()
    scheduler.step()


EXPECTED: dict = {
    # correct
    plain: OK,
    no_sync_style: OK,
    per_token_losses: OK,
    hf_num_items: OK,
    hf_num_items_tensor: OK,
    hf_mean_times_count: OK,
    per_row: OK,
    per_row_trimmed: OK,
    whole_window_in_one_forward: OK,
    logs_no_grad_loss_first: OK,
    eval_forward_first: OK,
    forward_without_backward_first: OK,
    evaluates_after_step: OK,
    detached_logging: OK,
    shifted_copy_of_labels: OK,
    one_backward_for_window: OK,
    autograd_grad_accumulated: OK,
    clip_above_the_norm: OK,
    clips_every_microbatch_above_the_norm: OK,
    shuffled_rows: OK,
    with_grad_scaler: OK,
    makes_a_cache_once: OK,
    keeps_only_the_latest_logits: OK,
    pairs_with_the_odd_one: OK,
    counts_after_the_shift_with_first_targets: OK,
    lightning_token_sum: OK,
    whole_window_in_a_closure: OK,
    torchtitan_train_step: OK,
    # one mistake each
    double_division: bad("double_division"),
    hf_num_items_over_a: bad("double_division"),
    average_of_averages: bad("average_of_averages"),
    hf_loss_over_a: bad("average_of_averages"),
    per_row_means: bad("average_of_averages"),
    ignored_tokens_counted: bad("ignored_tokens_counted"),
    mask_counted: bad("ignored_tokens_counted"),
    zero_grad_in_window: bad("zero_grad_in_window"),
    grads_dropped_by_hand: bad("zero_grad_in_window"),
    no_update: bad("no_update"),
    step_per_microbatch: bad("step_per_microbatch"),
    scheduler_per_microbatch: bad("scheduler_per_microbatch"),
    kept_losses: bad("kept_references"),
    kept_logits: bad("kept_references"),
    counts_before_shift: bad("count_before_shift"),
    hf_num_items_before_shift: bad("count_before_shift"),
    torchtune_single_device: bad("count_before_shift"),
    lightning_mean: bad("average_of_averages", "short_window_divided_by_a"),
    lightning_mean_per_window_a: bad("average_of_averages"),
    mask_minus_one_per_row: bad("ignored_tokens_counted"),
    mean_weighted_by_examples: bad("average_of_averages"),
    scheduler_before_step: bad("scheduler_before_optimizer"),
    scheduler_at_window_start: bad("scheduler_before_optimizer"),
    clips_every_microbatch: bad("clip_per_microbatch"),
    clips_every_microbatch_mildly: bad("clip_per_microbatch"),
    clips_before_each_backward: bad("clip_per_microbatch"),
    clips_values_every_microbatch: bad("clip_per_microbatch"),
    # lost, duplicated, misaligned
    skips_first: bad("lost_microbatches"),
    all_but_last: bad("lost_microbatches"),
    pops_microbatches: bad("lost_microbatches"),
    first_popped_for_logging: bad("lost_microbatches"),
    only_last_microbatch: bad("lost_microbatches"),
    only_last_over_window_targets: bad("lost_microbatches"),
    drops_last_row: bad("lost_microbatches"),
    forgot_backward: bad("lost_microbatches"),
    truncates_rows: bad("lost_microbatches", other=True),
    steps_before_last_microbatch: bad("lost_microbatches"),
    steps_first: bad("lost_microbatches", other=True),
    pairs_microbatches: bad("lost_microbatches"),
    first_microbatch_twice: bad("duplicated_microbatch"),
    window_twice: bad("duplicated_microbatch"),
    labels_not_shifted: bad("labels_not_shifted"),
    hf_labels_not_shifted_mean: bad("labels_not_shifted", "average_of_averages"),
    shifts_in_place_then_hf: bad("labels_shifted_twice", "window_modified_in_place"),
    shifts_in_place: bad("window_modified_in_place"),
    # outside the vocabulary
    never_cleared: bad(other=True),
    undivided: bad(other=True),
    without_scheduler: bad(other=True),
    scheduler_every_other_window: bad(other=True),
    clipped_below_the_norm: bad(other=True),
    doubled_loss: bad(other=True),
    divides_by_examples: bad(other=True),
    # combinations
    clinic_classic: bad("average_of_averages", "zero_grad_in_window", "scheduler_per_microbatch"),
    every_microbatch: bad("double_division", "step_per_microbatch", "scheduler_per_microbatch"),
    mean_over_positions: bad("double_division", "average_of_averages", "ignored_tokens_counted"),
    forgot_step_and_kept: bad("no_update", "kept_references"),
    review_window: bad(
        "average_of_averages", "zero_grad_in_window", "scheduler_per_microbatch", "kept_references"
    ),
    skips_first_mean_over_a: bad("lost_microbatches", "average_of_averages"),
    clips_and_steps_the_scheduler_per_microbatch: bad(
        "clip_per_microbatch", "scheduler_per_microbatch"
    ),
    clips_every_microbatch_over_a: bad("clip_per_microbatch"),
}
