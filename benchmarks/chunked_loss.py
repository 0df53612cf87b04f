"""The next-token loss without the logits: ``ChunkedNextTokenLoss`` against the
materialized loss (``head(hidden)`` then ``NextTokenLoss``), side by side in one run.

1. **Memory** at V = 32,000 and 128,256: the extra peak of the loss's forward + backward
   (the highest live bytes above what was live before the loss, measured with
   ``MemoryMeter``, the gradients it leaves included), in units of one float32 logits
   buffer ``m × T × V × 4`` bytes. Target: chunked <= 0.15; the materialized figure is
   printed beside it.
2. **Equality**: loss and gradients (hidden states, head weight) of both, relative
   difference. Targets: <= 1e-10 in float64, <= 1e-5 in float32.
3. **Time** of forward + backward, chunked against materialized (the head's matmul and
   the loss, both with their backward), median of paired runs that alternate the order.
   Target: ratio <= 1.5 on this device.
4. **Payoff** on the tiny GPT (``accumlab_course.models.TinyGPT``) with a 32,000-token
   vocabulary under one fixed memory budget (``MemoryMeter(budget_bytes=...)``): the
   largest microbatch ``m`` each loss fits (two windows of SGD with momentum, no
   out-of-memory error), the ``A`` giving the same effective batch, the time per update of
   both plans, and the final weights of both (the same update, up to float32 rounding).

Every target prints PASS or FAIL; the exit status is 1 when any fails.

    python benchmarks/chunked_loss.py            # about 1-2 minutes on 2 CPU cores
    python benchmarks/chunked_loss.py --quick    # smaller sizes, a smoke run
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

import accumlab as al
from accumlab.memory import MemoryMeter, format_bytes
from accumlab_course.models import TinyGPT

MEMORY_TARGET = 0.15  # × float32 logits bytes
TIME_TARGET = 1.5  # chunked / materialized, forward + backward
EQUALITY = {torch.float64: 1e-10, torch.float32: 1e-5}
LossFn = Callable[[nn.Linear, Tensor, Mapping[str, Tensor]], Tensor]

failures: list[str] = []


def verdict(ok: bool, what: str) -> str:
    if not ok:
        failures.append(what)
    return "PASS" if ok else "FAIL"


def materialized(head: nn.Linear, hidden: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
    """The head's matmul, then the loss over the full logits."""
    return al.NextTokenLoss().loss_sum(head(hidden), batch)


def chunked(head: nn.Linear, hidden: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
    return al.ChunkedNextTokenLoss(head).loss_sum(hidden, batch)


def problem(
    m: int, seq: int, width: int, vocab: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[nn.Linear, Tensor, dict[str, Tensor]]:
    """A head ``[V, H]`` (no bias, like GPT-2's), hidden states ``[m, T, H]`` that need a
    gradient, and labels with a masked prompt (an eighth of each row)."""
    torch.manual_seed(seed)
    head = nn.Linear(width, vocab, bias=False).to(dtype)
    hidden = torch.randn(m, seq, width, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (m, seq))
    labels[:, : seq // 8] = -100
    return head, hidden, {"labels": labels}


def forward_backward(loss_fn: LossFn, head: nn.Linear, hidden: Tensor, batch) -> list[Tensor]:
    """Loss, then its gradients w.r.t. the hidden states and the head weight (cleared)."""
    hidden.grad = head.weight.grad = None
    loss = loss_fn(head, hidden, batch)
    loss.backward()
    out = [loss.detach(), hidden.grad, head.weight.grad]
    hidden.grad = head.weight.grad = None
    return out


def extra_peak(loss_fn: LossFn, head: nn.Linear, hidden: Tensor, batch) -> int:
    """Peak live bytes of the loss's forward + backward above the bytes live before it."""
    hidden.grad = head.weight.grad = None
    meter = MemoryMeter("cpu")
    meter.watch(head, hidden)  # live before the loss: not part of its extra
    with meter.track():
        meter.reset()
        before = meter.live_bytes
        loss_fn(head, hidden, batch).backward()
        peak = meter.peak_bytes - before
    hidden.grad = head.weight.grad = None
    return peak


def paired_times(fns: dict[str, Callable[[], object]], pairs: int) -> dict[str, list[float]]:
    """Wall time of each function, run in pairs that alternate the order (AB, BA, ...)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(pairs):
        for name in names if i % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def memory_and_time(m: int, seq: int, width: int, vocabs: list[int], pairs: int) -> None:
    print(
        f"1. memory and 3. time: hidden (m, T, H) = ({m}, {seq}, {width}), head [V, {width}], "
        f"default chunk: {al.ChunkedNextTokenLoss(nn.Linear(1, vocabs[0])).effective_chunk_size}"
        f" tokens at V={vocabs[0]:,}"
    )
    print(
        f"{'V':>8} {'logits f32':>11} {'chunk':>6} {'materialized':>13} {'chunked':>8}"
        f" {'target':>7}   {'time mat.':>9} {'chunked':>8} {'ratio':>6} {'target':>7}"
    )
    for vocab in vocabs:
        one_vocabulary(m, seq, width, vocab, pairs)


def one_vocabulary(m: int, seq: int, width: int, vocab: int, pairs: int) -> None:
    """One row of part 1 and 3: extra peak of each loss and their times, at ``vocab``."""
    head, hidden, batch = problem(m, seq, width, vocab)
    unit = m * seq * vocab * 4
    chunk = al.ChunkedNextTokenLoss(head).effective_chunk_size
    peaks = {
        name: extra_peak(fn, head, hidden, batch) / unit
        for name, fn in (("materialized", materialized), ("chunked", chunked))
    }
    times = paired_times(
        {
            "materialized": lambda: forward_backward(materialized, head, hidden, batch),
            "chunked": lambda: forward_backward(chunked, head, hidden, batch),
        },
        pairs,
    )
    median = {k: statistics.median(v) for k, v in times.items()}
    ratio = median["chunked"] / median["materialized"]
    mem_ok = verdict(peaks["chunked"] <= MEMORY_TARGET, f"memory at V={vocab}")
    time_ok = verdict(ratio <= TIME_TARGET, f"time at V={vocab}")
    print(
        f"{vocab:>8,} {format_bytes(unit):>11} {chunk:>6} {peaks['materialized']:>12.2f}x"
        f" {peaks['chunked']:>7.3f}x {'<=' + str(MEMORY_TARGET):>7} {mem_ok}"
        f"   {median['materialized']:>8.2f}s {median['chunked']:>7.2f}s {ratio:>6.2f}"
        f" {'<=' + str(TIME_TARGET):>7} {time_ok}"
    )


def equality(m: int, seq: int, width: int, vocab: int) -> None:
    print(
        f"2. equality: (m, T, H, V) = ({m}, {seq}, {width}, {vocab:,}), largest relative "
        "difference of the loss and each gradient"
    )
    for dtype, tol in EQUALITY.items():
        head, hidden, batch = problem(m, seq, width, vocab, dtype, seed=1)
        ref = forward_backward(materialized, head, hidden, batch)
        got = forward_backward(chunked, head, hidden, batch)
        worst = max(
            float((g - r).abs().max() / r.abs().max()) for r, g in zip(ref, got, strict=True)
        )
        name = str(dtype).replace("torch.", "")
        print(
            f"   {name:<8} loss {float(ref[0]):.10g} vs {float(got[0]):.10g}; "
            f"relative difference {worst:.1e} <= {tol:g} {verdict(worst <= tol, f'{name} equality')}"
        )


# ------------------------------------------------------------------------ 4. payoff


def tiny_gpt_hidden(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """``forward=`` for ``TinyGPT``: its forward up to the final LayerNorm, no logits."""
    ids = batch["input_ids"]
    pos = torch.arange(ids.shape[1], device=ids.device)
    x = model.drop(model.tok_emb(ids) + model.pos_emb(pos))
    for block in model.blocks:
        x = block(x)
    return model.ln_f(x)


def gpt_batches(examples: int, m: int, seq: int, vocab: int) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (examples, seq), generator=g)
    labels = ids.clone()
    labels[:, : seq // 8] = -100
    return [
        {"input_ids": ids[i : i + m], "labels": labels[i : i + m]} for i in range(0, examples, m)
    ]


def train_plan(
    model: nn.Module,
    objective,
    forward,
    m: int,
    a: int,
    examples: int,
    seq: int,
    budget: int | None,
) -> tuple[float, list[Tensor]]:
    """Train a copy of ``model`` on ``examples`` sequences with plan ``(m, a)``: wall time
    per update and the final weights. ``torch.OutOfMemoryError`` from the meter's budget."""
    model = copy.deepcopy(model)
    head = model.lm_head
    objective = objective(head) if objective is not None else al.NextTokenLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    meter = MemoryMeter("cpu", budget_bytes=budget) if budget is not None else None
    data = gpt_batches(examples, m, seq, model.vocab_size)
    start = time.perf_counter()
    ledger = al.train(
        model,
        data,
        optimizer,
        al.AccumulationPlan(m, a),
        objective,
        forward=forward,
        meter=meter,
        progress=False,
    )
    per_update = (time.perf_counter() - start) / ledger.updates_applied
    return per_update, [p.detach().clone() for p in model.parameters()]


def payoff(vocab: int, seq: int, batch: int, budget: int, windows: int, repeats: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab, block_size=seq, n_layer=2, n_head=2, n_embd=32)
    plans = {
        "materialized": (None, None),
        "chunked": (lambda head: al.ChunkedNextTokenLoss(head), tiny_gpt_hidden),
    }
    sizes = [s for s in (batch, batch // 2, batch // 4, batch // 8, batch // 16, 1) if s >= 1]
    print(
        f"4. payoff: TinyGPT (2 layers, width 32, V={vocab:,}, T={seq}), effective batch "
        f"{batch} sequences, memory budget {format_bytes(budget)} (MemoryMeter, CPU)"
    )
    found: dict[str, int] = {}
    for name, (objective, forward) in plans.items():
        for m in sorted(set(sizes), reverse=True):
            try:  # two windows: the second one runs with the optimizer state already there
                train_plan(model, objective, forward, m, 1, 2 * m, seq, budget)
            except torch.OutOfMemoryError:
                continue
            found[name] = m
            break
        else:
            found[name] = 0
    if not found["materialized"]:
        print("   the materialized loss does not fit one sequence under this budget")
        failures.append("payoff: no m fits the materialized loss")
        return
    runs = [
        ("materialized", "materialized", found["materialized"]),
        ("chunked, same m", "chunked", found["materialized"]),
        ("chunked", "chunked", found["chunked"]),
    ]
    times: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    weights: dict[str, list[Tensor]] = {}
    for rep in range(repeats):  # the order alternates: a busy moment hits every plan
        for label, name, m in runs if rep % 2 == 0 else runs[::-1]:
            objective, forward = plans[name]
            per_update, weights[label] = train_plan(
                model, objective, forward, m, batch // m, windows * batch, seq, None
            )
            times[label].append(per_update)
    results = {label: (statistics.median(t), weights[label]) for label, t in times.items()}
    for label, name, m in runs:
        largest = "largest m" if m == found[name] else "        m"
        print(
            f"   {label:<16} {largest} = {m:>3}, A = {batch // m:>3} (m × A = {batch}): "
            f"{results[label][0]:.3f} s per update (median of {repeats})"
        )
    speedup = results["materialized"][0] / results["chunked"][0]
    same_m = results["materialized"][0] / results["chunked, same m"][0]
    diff = max(
        float((a - b).abs().max())
        for a, b in zip(results["materialized"][1], results["chunked"][1], strict=True)
    )
    print(
        f"   chunked plan: {found['chunked'] // found['materialized']}× the microbatch, "
        f"{speedup:.2f}× faster per update ({same_m:.2f}× from the loss alone at the same m); "
        f"final weights differ by at most {diff:.1e} (<= 1e-5) "
        f"{verdict(diff <= 1e-5, 'payoff: same weights')}; "
        f"larger m {verdict(found['chunked'] > found['materialized'], 'payoff: larger m')}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes: a smoke run")
    parser.add_argument("--pairs", type=int, default=3, help="timed pairs per vocabulary")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    if args.quick:
        memory_and_time(2, 512, 32, [32_000], pairs=1)
        equality(2, 32, 16, 4_096)
        payoff(32_000, 64, 16, 160 * 2**20, windows=1, repeats=1)
    else:
        memory_and_time(2, 512, 32, [32_000, 128_256], pairs=args.pairs)
        equality(2, 64, 32, 32_000)
        payoff(32_000, 64, 32, 160 * 2**20, windows=2, repeats=3)
    print(f"({time.perf_counter() - started:.0f} s)")
    print("all targets met" if not failures else f"targets NOT met: {', '.join(failures)}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
