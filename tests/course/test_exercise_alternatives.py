"""Every checker accepts right answers written in other styles.

Each answer below was written from the exercise's text in the notebook, not from the
reference solution: another order of operations, a loop where the reference is vectorised
(or the other way round), float64 where the reference is float32, microbatches without
targets skipped where the reference keeps them (their gradient is then ``None``, which
counts as zero). A checker that fails one of them fails a learner who is right.

``ex04.uneven_window``'s alternatives run on two gloo ranks, in the one launch of
``test_exercises_03_04.py``; notebook 07's are in ``test_exercises_07.py``.
"""

from __future__ import annotations

import math
from itertools import zip_longest
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from accumlab_course.exercises import ex00, ex01, ex02, ex03, ex04, ex05, ex06

# --------------------------------------------------------------------------- 00


def steps_by_search(effective_batch_size, micro_batch_size, data_parallel_size=1):
    per_window = micro_batch_size * data_parallel_size
    for a in range(1, effective_batch_size + 1):
        if per_window * a == effective_batch_size:
            return a
    raise ValueError("no whole number of microbatches gives this effective batch")


def steps_by_float_division(effective_batch_size, micro_batch_size, data_parallel_size=1):
    a = effective_batch_size / (micro_batch_size * data_parallel_size)
    if a < 1 or a != int(a):
        raise ValueError(f"A = {a} is not a whole number of microbatches")
    return int(a)


def replicas_by_subtraction(gpus, tensor_parallel_size=1, pipeline_parallel_size=1):
    per_copy, copies = tensor_parallel_size * pipeline_parallel_size, 0
    while gpus >= per_copy:
        gpus -= per_copy
        copies += 1
    if gpus or copies == 0:
        raise ValueError("the GPUs do not split into whole model copies")
    return copies


def replicas_stage_by_stage(gpus, tensor_parallel_size=1, pipeline_parallel_size=1):
    if gpus < tensor_parallel_size * pipeline_parallel_size:
        raise ValueError("fewer GPUs than one model copy needs")
    if gpus % tensor_parallel_size:
        raise ValueError("tensor-parallel groups do not fill the GPUs")
    groups = gpus // tensor_parallel_size
    if groups % pipeline_parallel_size:
        raise ValueError("pipeline stages do not fill the groups")
    return groups // pipeline_parallel_size


# --------------------------------------------------------------------------- ex01


def means_in_one_graph(model, window, mean_loss, count):
    counts = [count(mb) for mb in window]
    total = sum(counts)
    if total == 0:
        return
    pairs = zip(window, counts, strict=True)
    loss = sum(mean_loss(model, mb) * (n / total) for mb, n in pairs if n)
    loss.backward()  # one backward for the whole window


def means_reversed_divide_first(model, window, mean_loss, count):
    total = sum(count(mb) for mb in window)
    for mb in reversed(window):
        n = count(mb)
        if n:
            (mean_loss(model, mb) / total * n).backward()


def means_skip_nan_after_forward_float64(model, window, mean_loss, count):
    total = sum(count(mb) for mb in window)
    if total == 0:
        return
    for mb in window:
        loss = mean_loss(model, mb)
        if torch.isnan(loss):  # no units: its mean is 0/0
            continue
        (loss.double() * count(mb) / total).backward()


def weighted_update_one_graph(model, window, optimizer, scheduler=None):
    weights = torch.cat([mb["weight"] for mb in window])
    total = weights.sum()
    if float(total) == 0:
        return None
    optimizer.zero_grad()
    ce = torch.cat(
        [F.cross_entropy(model(mb["x"]), mb["labels"], reduction="none") for mb in window]
    )
    loss = (weights * ce).sum() / total
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if scheduler is not None:
        scheduler.step()
    return loss.item()


def weighted_update_skip_zero_weight_float64(model, window, optimizer, scheduler=None):
    total = sum(float(mb["weight"].double().sum()) for mb in window)
    if total <= 0:
        return None
    for p in model.parameters():
        p.grad = None  # whatever an earlier window left
    loss_sum = 0.0
    for mb in window:
        if not bool(mb["weight"].any()):
            continue  # nothing of this microbatch counts
        ce = F.cross_entropy(model(mb["x"]).double(), mb["labels"], reduction="none")
        part = (mb["weight"].double() * ce).sum()
        (part / total).backward()
        loss_sum += float(part.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # zeros instead of None: clean too
    if scheduler is not None:
        scheduler.step()
    return loss_sum / total


# --------------------------------------------------------------------------- ex02


def token_loss_skipping_empty(microbatch_logits, microbatch_labels):
    n = sum(int((y[:, 1:] != -100).sum()) for y in microbatch_labels)
    if n == 0:
        return None
    total = 0
    for x, y in zip(microbatch_logits, microbatch_labels, strict=True):
        targets = y[:, 1:]
        mask = targets != -100
        if not mask.any():
            continue  # no targets: this microbatch's logits get no gradient (None)
        total = total + F.cross_entropy(x[:, :-1][mask], targets[mask], reduction="sum")
    return total / n


def token_loss_gather_float64(microbatch_logits, microbatch_labels):
    losses, count = [], 0
    for x, y in zip(microbatch_logits, microbatch_labels, strict=True):
        log_p = torch.log_softmax(x[:, :-1].double(), dim=-1)
        targets = y[:, 1:]
        mask = targets != -100
        picked = log_p.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        losses.append(-(picked * mask).sum())
        count += int(mask.sum())
    if count == 0:
        return None
    return torch.stack(losses).sum() / count


def token_loss_one_flat_mean(microbatch_logits, microbatch_labels):
    vocab = microbatch_logits[0].shape[-1]
    logits = torch.cat([x[:, :-1].reshape(-1, vocab) for x in microbatch_logits])
    targets = torch.cat([y[:, 1:].reshape(-1) for y in microbatch_labels])
    if not bool((targets != -100).any()):
        return None
    return F.cross_entropy(logits, targets, ignore_index=-100)  # the mean over targets


def weighted_loss_skipping_rows(microbatch_logits, microbatch_labels, microbatch_weights):
    numerator, denominator = None, 0.0
    for x, y, w in zip(microbatch_logits, microbatch_labels, microbatch_weights, strict=True):
        targets = y[:, 1:]
        per_row = (targets != -100).sum(dim=1)
        denominator += float((w * per_row).sum())
        keep = (w > 0) & (per_row > 0)
        if not keep.any():
            continue  # this microbatch counts for nothing; its logits get no gradient
        kept_logits, kept_targets = x[keep][:, :-1], targets[keep]
        ce = F.cross_entropy(
            kept_logits.reshape(-1, kept_logits.shape[-1]), kept_targets.reshape(-1),
            ignore_index=-100, reduction="none",
        ).view(kept_targets.shape)
        part = (ce * w[keep][:, None]).sum()
        numerator = part if numerator is None else numerator + part
    if denominator == 0:
        return None
    return numerator / denominator


def weighted_loss_per_token_float64(microbatch_logits, microbatch_labels, microbatch_weights):
    losses, token_weights = [], []
    for x, y, w in zip(microbatch_logits, microbatch_labels, microbatch_weights, strict=True):
        targets = y[:, 1:]
        log_p = torch.log_softmax(x[:, :-1].double(), dim=-1)
        nll = -log_p.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
        per_token = w.double()[:, None].expand_as(nll) * (targets != -100)
        losses.append((nll * per_token).reshape(-1))
        token_weights.append(per_token.reshape(-1))
    denominator = torch.cat(token_weights).sum()
    if float(denominator) == 0:
        return None
    return torch.cat(losses).sum() / denominator


# --------------------------------------------------------------------------- ex03


def boundary_norm_by_hand(model, optimizer, scaler, max_norm):
    scaler.unscale_(optimizer)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
    applied = math.isfinite(norm)
    if applied:
        factor = max_norm / (norm + 1e-6)
        if factor < 1:
            for g in grads:
                g.mul_(factor)
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return applied, norm


def boundary_clip_raises_on_nonfinite(model, optimizer, scaler, max_norm):
    scaler.unscale_(optimizer)
    try:
        norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), max_norm, error_if_nonfinite=True
        )  # raises before it clips
        applied = True
    except RuntimeError:
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None]
        )
        applied = False
    if applied:
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=False)
    return applied, float(norm)


def schedule_streak(nonfinite, init_scale, growth_interval):
    used, scale, streak = [], float(init_scale), 0
    for bad in nonfinite:
        used.append(scale)
        streak = 0 if bad else streak + 1
        if bad:
            scale /= 2
        elif streak == growth_interval:
            scale, streak = scale * 2, 0
    return used


def schedule_float32_tensor(nonfinite, init_scale, growth_interval):
    scale, tracker, used = torch.tensor(init_scale, dtype=torch.float32), 0, []
    for bad in nonfinite:
        used.append(scale.item())
        if bad:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker >= growth_interval:
                scale, tracker = scale * 2.0, 0
    return used


def schedule_generator(nonfinite, init_scale, growth_interval):
    def scales():
        scale, run = init_scale, 0
        for bad in nonfinite:
            yield scale
            run = 0 if bad else run + 1
            scale = scale * 0.5 if bad else scale * (2.0 if run == growth_interval else 1.0)
            run = 0 if run == growth_interval else run

    return list(scales())



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


# --------------------------------------------------------------------------- the tests

ALTERNATIVES = [
    (ex00.accumulation_steps, steps_by_search),
    (ex00.accumulation_steps, steps_by_float_division),
    (ex00.replicas, replicas_by_subtraction),
    (ex00.replicas, replicas_stage_by_stage),
    (ex01.accumulate_from_means, means_in_one_graph),
    (ex01.accumulate_from_means, means_reversed_divide_first),
    (ex01.accumulate_from_means, means_skip_nan_after_forward_float64),
    (ex01.weighted_window_update, weighted_update_one_graph),
    (ex01.weighted_window_update, weighted_update_skip_zero_weight_float64),
    (ex02.window_token_loss, token_loss_skipping_empty),
    (ex02.window_token_loss, token_loss_gather_float64),
    (ex02.window_token_loss, token_loss_one_flat_mean),
    (ex02.window_weighted_loss, weighted_loss_skipping_rows),
    (ex02.window_weighted_loss, weighted_loss_per_token_float64),
    (ex03.window_boundary, boundary_norm_by_hand),
    (ex03.window_boundary, boundary_clip_raises_on_nonfinite),
    (ex03.scale_schedule, schedule_streak),
    (ex03.scale_schedule, schedule_float32_tensor),
    (ex03.scale_schedule, schedule_generator),
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


@pytest.mark.parametrize(
    ("exercise", "answer"), ALTERNATIVES, ids=[f"{e.name}-{a.__name__}" for e, a in ALTERNATIVES]
)
def test_a_right_answer_in_another_style_passes(exercise: Any, answer: Any) -> None:
    assert exercise.checker(answer) is None


def test_every_code_exercise_has_two_alternatives() -> None:
    code = {
        ex.name
        for module in (ex00, ex01, ex02, ex03, ex04, ex05, ex06)
        for ex in vars(module).values()
        if getattr(ex, "checker", None) is not None and "reference_" + ex.name in vars(module)
        and ex is not ex04.uneven_window  # two gloo ranks: test_exercises_03_04.py
    }
    counted = {name: sum(e.name == name for e, _ in ALTERNATIVES) for name in code}
    assert code and all(n >= 2 for n in counted.values()), counted


@pytest.mark.parametrize(
    ("exercise", "answers"),
    [
        (ex00.update_attempts, (3, 3.0)),
        (ex00.effective_batch, (64, 64.0)),
        (ex01.undivided_gradient, (8, 8.0)),
        (ex01.adamw_ratio, (1, 1.0, 1.001)),
        (ex02.second_contribution, (2.25, 18 / 8)),
        (ex02.same_direction, ("positions counted", "Positions-counted ")),
        (ex02.better_on_short_answers, ("average of averages", "AVERAGE OF AVERAGES")),
        (ex03.cpu_softmax_dtype, ("torch.bfloat16", " torch.bfloat16")),
        (ex03.fp16_of_4e_8, (2.0**-24, 5.96046e-8)),
        (ex03.adamw_steps_after_skip, (2, 2.0)),
    ],
    ids=lambda v: getattr(v, "name", ""),
)
def test_a_prediction_written_another_way_passes(exercise: Any, answers: tuple) -> None:
    for answer in answers:
        assert exercise.checker(answer) is None, answer


def weighted_update_clearing_first(model, window, optimizer, scheduler=None):
    optimizer.zero_grad(set_to_none=True)  # clears the stale .grad, also when it returns
    total = sum(float(mb["weight"].sum()) for mb in window)
    if total == 0:
        return None
    loss_sum = 0.0
    for mb in window:
        ce = F.cross_entropy(model(mb["x"]), mb["labels"], reduction="none")
        part = (mb["weight"] * ce).sum()
        (part / total).backward()
        loss_sum += float(part.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return loss_sum / total


def test_a_zero_weight_window_may_clear_or_keep_the_stale_gradient() -> None:
    """The text leaves it open; both an answer that clears ``.grad`` before it counts and
    ones that return first pass, and writing a gradient there is named."""
    assert ex01.weighted_window_update.checker(weighted_update_clearing_first) is None
    assert ex01.weighted_window_update.checker(weighted_update_one_graph) is None

    def writes_zero_window(model, window, optimizer, scheduler=None):
        if sum(float(mb["weight"].sum()) for mb in window) == 0:
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.5)
            return None
        return weighted_update_one_graph(model, window, optimizer, scheduler)

    assert ".grad was written" in ex01.weighted_window_update.checker(writes_zero_window)


def test_the_alternatives_are_not_the_references() -> None:
    modules = (ex00, ex01, ex02, ex03, ex04, ex05, ex06)
    references = {value for m in modules for key, value in vars(m).items() if key.startswith("reference_")}
    assert references
    assert not references & {answer for _, answer in ALTERNATIVES}
