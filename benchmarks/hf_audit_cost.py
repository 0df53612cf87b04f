"""What ``accumlab.hf.AuditCallback`` costs per update of a real ``Trainer`` run, on the tiny GPT.

Three runs of the same ``transformers.Trainer`` job (the tiny GPT as a GPT-2 built from its
config: 2 layers, width 64, 2 heads, dropout 0; the shipped examples, ``m`` per
microbatch, ``A`` per window; AdamW; fp32) side by side in one process, interleaved in a
rotating order for several repeats, each from the same weights:

- ``plain``: no audit;
- ``audited``: ``AuditCallback(steps=N)`` audits every update of the run;
- ``after``: ``AuditCallback(steps=1)`` audits the first update only; the updates after
  it are timed, to show the callback costs nothing once its audited updates are done.

Each run makes ``--warmup`` untimed updates first (default 2: the first creates the
optimizer's state; for ``after`` it is also the audited one) and then ``--updates`` timed
ones; an update is timed from the Trainer's
``on_step_begin`` to its ``on_step_end`` (every microbatch's forward and backward, the
audit when there is one, clipping, ``optimizer.step()``). Printed, for wall-clock and
process CPU time: the median milliseconds per update of each run, and the median (with
min and max) over repeats of the ratio to ``plain`` measured in the same repeat.

Target: ``audited`` at most 3x ``plain`` (the audit adds one forward and backward pass
over the window's examples for the reference, a copy of the gradient and a comparison,
so about 2x is expected); ``after`` 1.00 within noise.

Then, in the same run, ``audit_trainer`` on Llamas built from configs (fp32, three sizes,
each in a child process of its own so that its peak resident memory is its own): one
real update (``trainer.train()``, ``max_steps=1``, SGD) is made first and its high-water
mark read (``ru_maxrss``); then ``audit_trainer`` runs on a fresh Trainer of the same
model. Printed per size: trainable parameters, the audit's peak resident memory above the
update's high-water mark in bytes per trainable parameter (target: at most one fp32 copy,
4, plus one microbatch's activations), and the audit's wall time over one update's
(target: at most 3x).

    python benchmarks/hf_audit_cost.py            # 6 updates x 5 repeats, 1 thread
    python benchmarks/hf_audit_cost.py --quick    # 2 updates x 2 repeats: smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

try:
    import transformers
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        PrinterCallback,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )
except ImportError:  # pragma: no cover - the message is the point
    raise SystemExit(
        'benchmarks/hf_audit_cost.py needs transformers: pip install -e ".[hf]"'
    ) from None

from accumlab.hf import AuditCallback
from accumlab_course.data import VOCAB_SIZE, collate, load_examples

RUNS = ("plain", "audited", "after")


class StepTimer(TrainerCallback):
    """Wall and CPU seconds of each optimizer step, from on_step_begin to on_step_end."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._start = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        wall, cpu = self._start
        self.wall.append(time.perf_counter() - wall)
        self.cpu.append(time.process_time() - cpu)


def tiny_gpt() -> GPT2LMHeadModel:
    """The course's tiny GPT as a Hugging Face GPT-2 (same width, depth and heads)."""
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # a correct job: the audit's verdict is ok, no warning
    return model


def collate_lm(examples):  # type: ignore[no-untyped-def]
    batch = collate(examples)
    del batch["example_ids"]  # not a model input
    return batch


def time_run(
    run: str, examples: list, updates: int, warmup: int, m: int, a: int, out: str
) -> tuple[float, float]:
    """Median wall and CPU seconds per timed update of one run, after ``warmup`` untimed
    updates (for ``after``, the first of them is the audited one)."""
    timer = StepTimer()
    callbacks: list[TrainerCallback] = [timer]
    if run == "audited":
        callbacks.append(AuditCallback(steps=warmup + updates))
    elif run == "after":
        callbacks.append(AuditCallback(steps=1))
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=m,
        gradient_accumulation_steps=a,
        max_steps=warmup + updates,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    trainer = Trainer(
        model=tiny_gpt(),
        args=args,
        train_dataset=examples,
        data_collator=collate_lm,
        callbacks=callbacks,
    )
    trainer.remove_callback(PrinterCallback)  # no log line per run
    trainer.train()
    if run == "audited":
        assert len(callbacks[1].reports) == warmup + updates  # every update was audited
    return statistics.median(timer.wall[warmup:]), statistics.median(timer.cpu[warmup:])


def _ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=6, help="timed updates per run")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats")
    parser.add_argument("--warmup", type=int, default=2, help="untimed updates per run first")
    parser.add_argument("--micro-batch", type=int, default=4, help="examples per microbatch m")
    parser.add_argument("--steps", type=int, default=4, help="microbatches per window A")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="2 updates x 2 repeats: smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.updates, args.repeats = 2, 2
    if min(args.updates, args.repeats, args.micro_batch, args.steps, args.threads) < 1:
        parser.error("--updates, --repeats, --micro-batch, --steps and --threads must be >= 1")
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first update creates the optimizer's state)")

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers")
    examples = load_examples(limit=args.micro_batch * args.steps * (args.warmup + args.updates))

    wall: dict[str, list[float]] = {r: [] for r in RUNS}
    cpu: dict[str, list[float]] = {r: [] for r in RUNS}
    with tempfile.TemporaryDirectory() as out:
        for r in range(args.repeats):
            order = RUNS[r % 3 :] + RUNS[: r % 3]  # rotate who goes first
            for run in order:
                w, c = time_run(
                    run, examples, args.updates, args.warmup, args.micro_batch, args.steps, out
                )
                wall[run].append(w)
                cpu[run].append(c)

    n_params = sum(p.numel() for p in tiny_gpt().parameters())
    print(
        f"AuditCallback cost on the tiny GPT as GPT-2 ({n_params} parameters), transformers "
        f"{transformers.__version__}, CPU, {args.threads} thread(s); m={args.micro_batch}, "
        f"A={args.steps}, {args.warmup} untimed + {args.updates} timed updates x "
        f"{args.repeats} repeats "
        "(medians; ratio min-max in brackets)"
    )
    print(
        f"{'run':>8} | {'wall ms/update':>14} | {'x plain (wall)':>20} | "
        f"{'cpu ms/update':>13} | {'x plain (cpu)':>20}"
    )
    for run in RUNS:
        wall_ratio = [w / p for w, p in zip(wall[run], wall["plain"], strict=True)]
        cpu_ratio = [c / p for c, p in zip(cpu[run], cpu["plain"], strict=True)]
        print(
            f"{run:>8} | {1e3 * statistics.median(wall[run]):14.1f} | {_ratio(wall_ratio):>20} | "
            f"{1e3 * statistics.median(cpu[run]):13.1f} | {_ratio(cpu_ratio):>20}"
        )
    audited = statistics.median(c / p for c, p in zip(cpu["audited"], cpu["plain"], strict=True))
    print(f"target: audited <= 3x plain (CPU time): {'met' if audited <= 3 else 'NOT met'}")
    return 0


#: (layers, width) of the three Llamas (vocabulary 2048, 4 heads, MLP 4 x width)
LLAMAS = ((2, 128), (4, 256), (6, 384))


def llama_child(layers: int, width: int, m: int, a: int) -> dict[str, float]:
    """One size in this process: a real update's high-water mark and time, then the
    audit's (see the module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import accumlab.hf as ah

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=2048, hidden_size=width, intermediate_size=4 * width,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=256, attention_dropout=0.0)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 2048, (int(n),), generator=g).tolist()}
            for n in torch.randint(48, 96, (m * a,), generator=g)]

    def collate(features):
        width_ = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), width_, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, f in enumerate(features):
            ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
            mask[i, : len(f["input_ids"])] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as out:
        def trainer():
            targs = TrainingArguments(out, per_device_train_batch_size=m, gradient_accumulation_steps=a,
                                      max_steps=1, optim="sgd", learning_rate=1e-3, report_to=[],
                                      save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                      use_cpu=True, seed=0)
            return Trainer(model=model, args=targs, train_dataset=rows, data_collator=collate)

        trainer().train()  # warm-up: allocator and kernels
        t = trainer()
        start = time.perf_counter()
        t.train()
        update = time.perf_counter() - start
        high = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t = trainer()
        start = time.perf_counter()
        report = ah.audit_trainer(t)
        audit = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"params": params, "extra_bytes": peak - high, "update_s": update, "audit_s": audit,
            "checked": report.checked}


def llama_table(m: int, a: int) -> None:
    print(f"\naudit_trainer on Llamas from configs (fp32, m={m}, A={a}, 1 thread; a child process per size)")
    print(f"{'layers x width':>14} | {'trainable':>10} | {'extra bytes/param':>17} | {'audit / update (wall)':>21}")
    for layers, width in LLAMAS:
        done = subprocess.run([sys.executable, __file__, "--llama-child", f"{layers},{width},{m},{a}"],
                              capture_output=True, text=True, check=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{f'{layers} x {width}':>14} | {r['params']:>10} | {r['extra_bytes'] / r['params']:17.1f} | "
              f"{r['audit_s'] / r['update_s']:21.2f}")
    print("targets: extra <= 4 bytes/param (one fp32 copy) + one microbatch's activations; time <= 3x")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--llama-child":
        print(json.dumps(llama_child(*map(int, sys.argv[2].split(",")))))
        raise SystemExit(0)
    code = main()
    llama_table(2, 4)
    raise SystemExit(code)
