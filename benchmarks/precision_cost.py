"""What mixed precision costs per update on the tiny GPT: fp32 vs bf16 vs fp16.

One update = one window of A microbatches through ``accumlab.train_window`` (forward
under the precision's autocast, backward, and the boundary: unscale, check, step, update
the scale). The three precisions run interleaved, in a rotating order, for several
repeats; each repeat times ``--updates`` update attempts after one warm-up update, on a
fresh copy of the same model. Printed, for wall-clock time and for the process's CPU
time: the median milliseconds per update attempt, and the median (with min and max) over
repeats of the ratio to fp32 measured in the same repeat (side by side, so machine noise
hits both terms alike); and how many timed attempts were skipped (non-finite gradient).

On a CPU expect bf16 and fp16 to be *slower* than fp32: autocast adds casts around
every matmul, and CPU kernels for half-precision types are rarely faster for matrices
this small. On a GPU, tensor cores make 16-bit matrix products faster, but this model is
small enough that kernel launches may dominate; the script reports what it measures.

    python benchmarks/precision_cost.py                 # CPU, 1 thread, 6 updates x 5 repeats
    python benchmarks/precision_cost.py --quick         # 2 updates x 2 repeats: smoke run
    python benchmarks/precision_cost.py --device cuda   # on a GPU
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import accumlab as al
from accumlab.precision import PRECISIONS
from accumlab_course.data import VOCAB_SIZE, load_examples, microbatches
from accumlab_course.models import TinyGPT


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_updates(
    model: torch.nn.Module,
    windows: list[list[dict[str, torch.Tensor]]],
    precision: str,
    updates: int,
) -> tuple[float, float, al.Ledger]:
    """Wall-clock and process CPU seconds per update attempt over ``updates`` windows,
    after one warm-up window, and the ledger of the timed attempts."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    objective = al.NextTokenLoss()
    policy = al.precision_policy(precision, device)
    scaler = al.resolve_scaler(policy, None)  # one scaler for the run (fp16 only)
    ledger = al.Ledger()
    al.train_window(model, windows[0], optimizer, objective, precision=precision, scaler=scaler)
    _sync(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(updates):
        window = windows[(i + 1) % len(windows)]
        ledger.record(
            al.train_window(
                model, window, optimizer, objective, precision=precision, scaler=scaler, index=i
            )
        )
    _sync(device)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return wall / updates, cpu / updates, ledger


def _ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--updates", type=int, default=6, help="timed update attempts per run")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats")
    parser.add_argument("--micro-batch", type=int, default=4, help="examples per microbatch m")
    parser.add_argument("--steps", type=int, default=4, help="microbatches per window A")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="2 updates x 2 repeats: smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.updates, args.repeats = 2, 2
    if args.updates < 1 or args.repeats < 1:
        parser.error("--updates and --repeats must be at least 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU; this machine has none")

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    per_window = args.micro_batch * args.steps
    examples = load_examples(limit=per_window * 4)
    batches = [
        {k: v.to(device) for k, v in mb.items()}
        for mb in microbatches(examples, args.micro_batch)
    ]
    windows = [batches[i : i + args.steps] for i in range(0, len(batches), args.steps)]
    torch.manual_seed(0)
    base = TinyGPT(VOCAB_SIZE).to(device)

    wall: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    cpu: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    wall_ratio: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    cpu_ratio: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    skipped: dict[str, int] = dict.fromkeys(PRECISIONS, 0)
    attempts: dict[str, int] = dict.fromkeys(PRECISIONS, 0)
    for r in range(args.repeats):
        order = PRECISIONS[r % 3 :] + PRECISIONS[: r % 3]  # rotate who goes first
        this_wall, this_cpu = {}, {}
        for precision in order:
            w, c, ledger = time_updates(copy.deepcopy(base), windows, precision, args.updates)
            this_wall[precision], this_cpu[precision] = w, c
            wall[precision].append(w)
            cpu[precision].append(c)
            skipped[precision] += ledger.updates_skipped
            attempts[precision] += ledger.update_attempts
        for precision in PRECISIONS:
            wall_ratio[precision].append(this_wall[precision] / this_wall["fp32"])
            cpu_ratio[precision].append(this_cpu[precision] / this_cpu["fp32"])

    print(
        f"precision cost on TinyGPT ({sum(p.numel() for p in base.parameters())} parameters), "
        f"device {device}, {args.threads} thread(s); m={args.micro_batch}, A={args.steps}, "
        f"{args.updates} updates x {args.repeats} repeats (medians; ratio min-max in brackets)"
    )
    print(
        f"{'precision':>9} | {'wall ms/update':>14} | {'x fp32 (wall)':>20} | "
        f"{'cpu ms/update':>13} | {'x fp32 (cpu)':>20} | skipped/attempts"
    )
    for p in PRECISIONS:
        print(
            f"{p:>9} | {1e3 * statistics.median(wall[p]):14.1f} | "
            f"{_ratio(wall_ratio[p]):>20} | {1e3 * statistics.median(cpu[p]):13.1f} | "
            f"{_ratio(cpu_ratio[p]):>20} | {skipped[p]}/{attempts[p]}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
