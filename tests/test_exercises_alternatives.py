"""Right answers written apart from the references, in other styles (issue 26): every
checker of notebooks 04-06 must accept each of them. They were written from the exercise
text in the notebook, not from the reference solutions: loops against vectorised code,
other orders of operations, other dtypes. A checker that fails one of them is a bug.

(``ex04.uneven_window``'s alternatives run on two gloo ranks, in the one launch of
``tests/test_exercises_03_05.py``; notebook 07's are in ``tests/test_exercises_07.py``.)
"""

from __future__ import annotations

import math
from itertools import zip_longest
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from accumlab.course.exercises import ex04, ex05, ex06

# ---------------------------------------------------------------- 04 padding_plan


def padding_by_loops(microbatches_per_rank, accumulation_steps):
    windows = []
    for n in microbatches_per_rank:
        mine = []
        while n > 0:
            mine.append(min(accumulation_steps, n))
            n -= accumulation_steps
        windows.append(mine)
    plan = []
    for mine in windows:
        row = []
        for i, column in enumerate(zip_longest(*windows, fillvalue=0)):
            row.append(max(column) - (mine[i] if i < len(mine) else 0))
        plan.append(row)
    return plan


def padding_by_arithmetic(microbatches_per_rank, accumulation_steps):
    a = accumulation_steps
    attempts = max(math.ceil(n / a) for n in microbatches_per_rank)

    def length(n, i):  # rank with n microbatches, its window i (0 when it has none)
        return max(0, min(a, n - i * a))

    most = [max(length(n, i) for n in microbatches_per_rank) for i in range(attempts)]
    return [[most[i] - length(n, i) for i in range(attempts)] for n in microbatches_per_rank]


# ---------------------------------------------------------------- 05 shrink_plan


def shrink_round_robin(m, A, D, largest):
    if largest < 1:
        raise ValueError("largest must be at least 1")
    examples = m * A
    count = -(-examples // largest)
    sizes = [0] * count
    for k in range(examples):  # deal the examples out one at a time
        sizes[k % count] += 1
    return sizes


def shrink_smallest_first(m, A, D, largest):
    if largest < 1:
        raise ValueError("nothing fits")
    total, count = m * A, math.ceil(m * A / largest)
    small = total // count
    return sorted([small] * (count - total % count) + [small + 1] * (total % count))


# ---------------------------------------------------------------- 05 plan_under_budget


def budget_by_algebra(peaks, budget, effective_batch, replicas=1):
    if effective_batch % replicas != 0:
        raise ValueError("replicas do not divide the batch")
    window = effective_batch // replicas
    low, high = min(peaks), max(peaks)
    slope = (peaks[high] - peaks[low]) / (high - low)
    intercept = peaks[low] - slope * low
    m_max = math.floor((budget - intercept) / slope)  # the line solved for m
    fits = [m for m in range(1, min(m_max, window) + 1) if window % m == 0]
    if not fits:
        raise ValueError("not even m = 1 fits")
    return fits[-1], window // fits[-1]


def budget_upwards_in_float64(peaks, budget, effective_batch, replicas=1):
    if effective_batch % replicas:
        raise ValueError("uneven replicas")
    window = effective_batch // replicas
    xs = torch.tensor(sorted(peaks), dtype=torch.float64)
    ys = torch.tensor([peaks[int(x)] for x in xs], dtype=torch.float64)
    x0, x1, y0, y1 = xs[0], xs[-1], ys[0], ys[-1]
    best = None
    for m in range(1, window + 1):  # upwards; keep the last that fits
        predicted = y0 + (m - x0) * (y1 - y0) / (x1 - x0)
        if window % m == 0 and float(predicted) <= budget:
            best = m
    if best is None:
        raise ValueError("even one example per microbatch is over the budget")
    return best, window // best


# ---------------------------------------------------------------- 05 chunked_loss_sum


def chunked_by_logsumexp(hidden, weight, targets, chunk):
    total = torch.zeros((), dtype=torch.float64)
    for rows, wanted in zip(hidden.split(chunk), targets.split(chunk), strict=True):
        keep = wanted != -100
        if not bool(keep.any()):
            continue
        logits = (rows[keep] @ weight.T).double()
        picked = logits.gather(1, wanted[keep][:, None])[:, 0]
        total += (logits.logsumexp(dim=1) - picked).sum()
    return total.float()


def chunked_targets_first(hidden, weight, targets, chunk):
    keep = targets != -100  # only positions with a target, then chunks of them
    rows, wanted = hidden[keep], targets[keep]
    parts = [F.cross_entropy(rows[i:i + chunk] @ weight.T, wanted[i:i + chunk],
                             reduction="sum") for i in range(0, len(wanted), chunk)]
    return torch.stack(parts).sum() if parts else torch.zeros(())


# ---------------------------------------------------------------- 06 sequence_weighted_window


def sequence_weighted_per_sequence(model, window, sequence_losses):
    sequences = sum(len(mb["labels"]) for mb in window)
    for mb in window:
        for row in range(len(mb["labels"])):  # one sequence at a time
            ids, labels = mb["input_ids"][row:row + 1], mb["labels"][row:row + 1]
            (sequence_losses(model(ids).logits, labels)[0] / sequences).backward()


def sequence_weighted_by_means(model, window, sequence_losses):
    sizes = [mb["labels"].shape[0] for mb in window]
    for mb, size in zip(window, sizes, strict=True):
        mean = sequence_losses(model(mb["input_ids"]).logits, mb["labels"]).mean()
        (mean * (size / sum(sizes))).backward()  # the microbatch's share of the sequences


# ---------------------------------------------------------------- 06 contrastive_window


def contrastive_with_autograd_grad(model, window, loss_fn):
    with torch.no_grad():
        q = [model(mb["queries"]) for mb in window]
        k = [model(mb["keys"]) for mb in window]
    q_all, k_all = torch.cat(q).requires_grad_(True), torch.cat(k).requires_grad_(True)
    dq, dk = torch.autograd.grad(loss_fn(q_all, k_all), (q_all, k_all))
    for i, mb in enumerate(window):
        start = sum(len(x) for x in q[:i])
        end = start + len(q[i])
        surrogate = (model(mb["queries"]) * dq[start:end]).sum() + (
            model(mb["keys"]) * dk[start:end]).sum()
        surrogate.backward()  # its gradient is the chain rule through the embeddings


def contrastive_keys_first(model, window, loss_fn):
    with torch.no_grad():  # all rows in one pass without autograd: no activations kept
        keys = model(torch.cat([mb["keys"] for mb in window]))
        queries = model(torch.cat([mb["queries"] for mb in window]))
    keys.requires_grad_()
    queries.requires_grad_()
    loss_fn(queries, keys).backward()
    offsets = [0]
    for mb in window:
        offsets.append(offsets[-1] + len(mb["keys"]))
    for mb, a, b in zip(window, offsets, offsets[1:], strict=False):  # keys, then queries
        model(mb["keys"]).backward(keys.grad[a:b])
        model(mb["queries"]).backward(queries.grad[a:b])


ALTERNATIVES: list[tuple[Any, Any]] = [
    (ex04.padding_plan, padding_by_loops),
    (ex04.padding_plan, padding_by_arithmetic),
    (ex05.shrink_plan, shrink_round_robin),
    (ex05.shrink_plan, shrink_smallest_first),
    (ex05.plan_under_budget, budget_by_algebra),
    (ex05.plan_under_budget, budget_upwards_in_float64),
    (ex05.chunked_loss_sum, chunked_by_logsumexp),
    (ex05.chunked_loss_sum, chunked_targets_first),
    (ex06.sequence_weighted_window, sequence_weighted_per_sequence),
    (ex06.sequence_weighted_window, sequence_weighted_by_means),
    (ex06.contrastive_window, contrastive_with_autograd_grad),
    (ex06.contrastive_window, contrastive_keys_first),
]


@pytest.mark.parametrize(("exercise", "answer"), ALTERNATIVES,
                         ids=[f"{e.name}-{a.__name__}" for e, a in ALTERNATIVES])
def test_a_right_answer_in_another_style_passes(exercise, answer, capsys):
    assert exercise.check(answer) is True, capsys.readouterr().out


def test_the_alternatives_are_not_the_references():
    references = {ex04.reference_padding_plan, ex05.reference_shrink_plan,
                  ex05.reference_plan_under_budget, ex05.reference_chunked_loss_sum,
                  ex06.reference_sequence_weighted_window, ex06.reference_contrastive_window}
    assert not references & {answer for _, answer in ALTERNATIVES}
