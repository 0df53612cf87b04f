"""Train the tiny GPT with data parallelism: the same code under torchrun or a local launch.

Under torchrun (one machine, two processes; gloo on CPU, nccl with a GPU per process):

    python -m torch.distributed.run --nproc_per_node=2 examples/ddp_train.py

On several machines, run the same line on each with its own --node_rank:

    python -m torch.distributed.run --nnodes=2 --nproc_per_node=8 --node_rank=0 \\
        --master_addr=10.0.0.1 --master_port=29500 examples/ddp_train.py

Without torchrun, ``--nproc N`` spawns N local processes itself (accumlab.distributed.launch);
``--nproc 1`` trains single-process. Rank 0 prints the run record summed over all ranks
and the example-ID check (every example exactly once); ``--record`` writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from accumlab import distributed
from accumlab_course import workers
from accumlab_course.cli import parse_positive_int, parse_seed


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    count = parse_positive_int  # a whole number >= 1, else a usage error naming the flag
    p.add_argument("--examples", type=count, default=64, help="first N examples of the data set")
    p.add_argument("--micro", type=count, default=4, help="examples per microbatch (m)")
    p.add_argument("--steps", type=count, default=2, help="microbatches per window (A)")
    p.add_argument("--fsdp2", action="store_true", help="shard with fully_shard instead of DDP")
    p.add_argument("--nproc", type=count, default=2, help="local processes when not under torchrun")
    p.add_argument("--seed", type=parse_seed, default=0, help="0 to 2**64 - 1")
    p.add_argument("--record", default=None, help="write the run record (JSON) here")
    return p.parse_args(argv)


def report(result: dict, record_path: str | None) -> None:
    """Print what rank 0 returned; write the record if asked."""
    record = result["record"]
    print(
        f"D={record['data_parallel_size']}: {record['update_attempts']} update attempts, "
        f"{record['examples']} examples / {record['targets']} targets over all ranks "
        f"(per rank: {record['extra'].get('examples_per_rank')} examples)"
    )
    print(f"example IDs: {result['ids']}")
    if record_path:
        Path(record_path).write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"run record written to {record_path}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    config = (args.examples, args.micro, args.steps, "fsdp2" if args.fsdp2 else "ddp", args.seed)
    if distributed.init_from_env():  # started by torchrun: this process is one rank
        try:
            result = workers.train_tiny_gpt(*config)
            if dist.get_rank() == 0:
                report(result, args.record)
        finally:
            dist.destroy_process_group()
        return 0
    if args.nproc == 1:
        result = workers.train_tiny_gpt(*config[:3], "none", args.seed)
    else:
        result = distributed.launch(workers.train_tiny_gpt, args.nproc, config)[0]
    report(result, args.record)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
