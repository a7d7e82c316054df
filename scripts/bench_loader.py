"""How fast the data loader makes batches, to hold against the trainer's tokens/s.

    python scripts/bench_loader.py [--steps 200] [--dp 1] \
        data.source=binary data.path=data/corpus.bin training.seq_len=256

Composes the config as train.py does (any overrides), builds the training windows (timed: a text,
json or parquet source is tokenized into the cache then, unless it is there) and reads `--steps`
global batches as data-parallel rank 0 of `--dp` (with 1: the whole job's tokens, so the figure is
the loader's ceiling per process). Prints the process's peak resident memory (VmHWM) at the end.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from trainer.checks.job import check_data  # noqa: E402
from trainer.config.files import CONFIG_DIR, register_configs  # noqa: E402
from trainer.data import BatchLoader, build_dataset  # noqa: E402


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dp", type=int, default=1,
                        help="read as rank 0 of this many data-parallel ranks")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        job = OmegaConf.to_object(compose(config_name="config", overrides=args.overrides))
    t = job.training
    check_data(job.data)
    started = time.perf_counter()
    dataset = build_dataset(job.data, t.seq_len, t.seed)
    built = time.perf_counter()
    loader = BatchLoader(dataset, t.global_batch_size, dp_rank=0, dp_size=args.dp,
                         grad_accum=t.grad_accum_steps, seed=t.seed)
    for step in range(args.steps):
        loader.microbatches(step)
    seconds = time.perf_counter() - built
    tokens = args.steps * t.global_batch_size * t.seq_len // args.dp
    peak = int(re.search(r"VmHWM:\s+(\d+) "
                         r"kB", Path("/proc/self/status").read_text()).group(1)) / 1024
    print(f"data.source={job.data.source}: windows ready in {built - started:.1f}s; {args.steps} "
          f"batches of {t.global_batch_size // args.dp} x {t.seq_len} in {seconds:.2f}s: "
          f"{tokens / seconds:,.0f} tokens/s; peak RSS {peak:,.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1:])
