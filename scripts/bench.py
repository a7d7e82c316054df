"""Throughput of the real trainer next to a plain PyTorch loop on the same model and batch.

    python scripts/bench.py --runs llama_fsdp:1 llama_fsdp:2 --threads 2 --out bench.json \
        model.n_layers=6 model.n_kv_heads=16 training.seq_len=2048 training.global_batch_size=8

A run is `recipe:ranks`, optionally with its own overrides:
`llama_tp2:4:parallel.tp=4,parallel.dp_shard=1`. Each run launches train.py (torchrun for more than
one rank) with the total `--threads` split evenly over its ranks and reads its metrics.jsonl: the
median tokens/s and MFU after the warm-up steps, and the peak memory of rank 0. The plain loop
(forward, cross-entropy, backward, AdamW: no framework) runs with all `--threads` in a process of
its own.

A shared 2-core machine drifts by several percent over minutes, so runs go round-robin
`--repeats` times and each row is the repeat with the median tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def run_trainer(recipe: str, ranks: int, threads: int, steps: int, warmup: int,
                overrides: list[str], label: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, threads // ranks))}
    with tempfile.TemporaryDirectory() as out:
        # +smoke=cpu: the recipe's layout without its GPU sizing (accumulation, checkpointing), so
        # the trainer runs the plain loop's batch in one microbatch.
        args = [f"+recipe={recipe}", "+smoke=cpu", f"training.steps={steps}", "metrics.log_every=1",
                "metrics.peak_tflops=auto", f"output_dir={out}", *overrides]
        launcher = [sys.executable] if ranks == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={ranks}"]
        result = subprocess.run([*launcher, str(REPO / "train.py"), *args], cwd=REPO, env=env,
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"{recipe} on {ranks} ranks failed:\n{result.stderr[-3000:]}")
        records = [json.loads(line)
                   for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    measured = records[warmup:]
    return {
        "name": label, "ranks": ranks, "threads_per_rank": max(1, threads // ranks),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in measured),
        "mfu": statistics.median(r["mfu"] for r in measured),
        "mem_gib": max(r["mem_gib"] for r in measured),
        "param_mib": measured[-1]["param_mib"],
    }


def run_plain_loop(threads: int, steps: int, warmup: int, overrides: list[str]) -> dict:
    """The baseline: the same model and batch shape, trained by the simplest PyTorch loop (under
    bf16 autocast when the overrides set training.mixed_precision.param_dtype=bfloat16)."""
    import torch
    import torch.nn.functional as F
    from hydra import compose, initialize_config_dir

    from trainer import build_model
    from trainer.config.files import CONFIG_DIR, register_configs
    from trainer.hardware import measure_cpu_tflops
    from trainer.observe.measured_memory import peak_memory_gib
    from trainer.observe.metrics import flops_per_token
    from trainer.run.allocator import reuse_freed_memory

    torch.set_num_threads(threads)
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config",
                      overrides=[o for o in overrides if not o.startswith("parallel.")])
    batch, seq_len = cfg.training.global_batch_size, cfg.training.seq_len
    # the trainer's allocator settings, so the ratios measure the rest
    if cfg.training.cpu_reuse_memory:
        reuse_freed_memory()
    model = build_model(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.training.lr)
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, seq_len + 1))
    bf16 = cfg.training.mixed_precision.param_dtype == "bfloat16"
    rates = []
    for step in range(steps):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss.item()
        if step >= warmup:
            rates.append(batch * seq_len / (time.perf_counter() - start))
    tokens_per_s = statistics.median(rates)
    peak = measure_cpu_tflops()
    return {
        "name": "plain PyTorch loop" + (" (bf16 autocast)" if bf16 else ""), "ranks": 1,
        "threads_per_rank": threads, "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token(cfg.model, seq_len) / (peak * 1e12),
        "mem_gib": peak_memory_gib(torch.device("cpu")),
        "param_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
    }


def plain_loop_in_subprocess(threads: int, steps: int, warmup: int, overrides: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, __file__, "--plain-loop", f"--threads={threads}", f"--steps={steps}",
           f"--warmup={warmup}", *overrides]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"plain loop failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=["llama_fsdp:1", "llama_fsdp:2"],
                        help="recipe:ranks")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="CPU threads in total, split over ranks")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--model", default="llama_debug")
    parser.add_argument("--repeats", type=int, default=1,
                        help="round-robin repeats; rows are medians")
    parser.add_argument("--out", default="bench.json")
    parser.add_argument("--plain-loop", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*",
                        help="config overrides for every run, e.g. training.seq_len=2048")
    args = parser.parse_args()

    if args.plain_loop:
        print(json.dumps(run_plain_loop(args.threads, args.steps, args.warmup, args.overrides)))
        return
    overrides = [f"model={args.model}", *args.overrides]
    measures = [lambda: plain_loop_in_subprocess(args.threads, args.steps, args.warmup, overrides)]
    for run in args.runs:
        recipe, ranks, *extra = run.split(":")
        extra = extra[0].split(",") if extra else []
        label = " ".join([recipe, *extra])
        measures.append(lambda recipe=recipe, ranks=int(ranks), extra=extra,
                        label=label: run_trainer(
recipe, ranks, args.threads, args.steps, args.warmup, [*overrides, *extra], label))
    repeats = [[measure() for measure in measures] for _ in range(args.repeats)]
    rows = [sorted(results, key=lambda r: r["tokens_per_s"])[len(results) // 2]
            for results in zip(*repeats)]
    baseline = rows[0]["tokens_per_s"]
    for row in rows:
        row["vs_plain"] = row["tokens_per_s"] / baseline

    width = max(len(r["name"]) for r in rows)
    print(f"{'run':<{width}} {'ranks':>5} {'thr/rank':>8} {'tokens/s':>10} {'vs plain':>8} "
          f"{'MFU':>7} {'mem GiB':>8} {'params MiB/rank':>15}")
    for r in rows:
        print(f"{r['name']:<{width}} {r['ranks']:>5} {r['threads_per_rank']:>8} "
              f"{r['tokens_per_s']:>10,.0f} {r['vs_plain']:>8.2f} {100 * r['mfu']:>6.1f}% "
              f"{r['mem_gib']:>8.2f} {r['param_mib']:>15.1f}")
    Path(args.out).write_text(json.dumps({"overrides": overrides, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
