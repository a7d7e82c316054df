"""Per-rank memory and step time of a job at its real size, before launching it.

    python scripts/plan.py +recipe=llama_4d    # the recipe on its stated hardware
    python scripts/plan.py +recipe=llama_fsdp --world 16 --device a100 \
        training.activation_checkpoint=full
    python scripts/plan.py +recipe=llama_tp2_pp4 --json
    python scripts/plan.py --search --gpus 64 --device h100 model=llama3_70b
    python scripts/plan.py --calibrate --name my-box --world 2 model=llama_debug +smoke=cpu
    # parallel=auto's pick, measured against every layout the search considers
    python scripts/plan.py --rank --world 4 model=llama_debug +smoke=cpu

Overrides are train.py's. `--world` and `--device` default to the recipe's `plan.world_size` and
`plan.device` (else 1 rank of an h100). One process plays every rank in a fake process group.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainer.checks.overrides import compose_job  # noqa: E402
from trainer.errors import ConfigError  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, help="ranks (default: the recipe's plan.world_size)")
    parser.add_argument("--device",
                        help="h100, h200, a100, b200 or cpu (default: the recipe's plan.device)")
    parser.add_argument("--device-memory-gib", type=float,
                        help="memory per device, instead of the table's")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--search", action="store_true",
                        help="rank the layouts that fit --gpus devices")
    parser.add_argument("--gpus", type=int, help="with --search: the number of devices")
    parser.add_argument("--gpus-per-node", type=int,
                        help="with --search: devices per node (default: the table's)")
    parser.add_argument("--top", type=int, default=10,
                        help="with --search: how many layouts to print")
    parser.add_argument("--calibrate", action="store_true",
                        help="run the job in a few layouts on --world ranks of this machine and "
                             "write the profile --name, whose efficiencies make the plan predict "
                             "what was measured")
    parser.add_argument("--name",
                        help="with --calibrate: the profile (devices/NAME.json, or a path ending "
                             ".json)")
    parser.add_argument("--steps", type=int, default=8,
                        help="with --calibrate or --rank: steps a layout runs")
    parser.add_argument("--rank", action="store_true",
                        help="run every layout the search considers on --world ranks of this "
                             "machine and print the plan's ranking beside the measured one: with "
                             "--calibrate after fitting the profile, alone with the figures "
                             "parallel=auto ranks with (--device, else the recipe's)")
    args, overrides = parser.parse_known_args(argv)
    try:
        job = compose_job(overrides)
        from trainer.models import import_modules

        import_modules(job.imports)
        if args.search:
            return search_command(job, args)
        if args.calibrate:
            return calibrate_command(job, args, overrides)
        if args.rank:
            return rank_command(job, args, overrides)
        return plan_command(job, args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2


def given_world(args) -> int | None:
    """--world as given (None where it is not); below 1 a config error."""
    if args.world is not None and args.world < 1:
        raise ConfigError(f"--world={args.world} must be at least 1")
    return args.world


def plan_command(job, args) -> int:
    from trainer.checks.job import check_job
    from trainer.plan import make_plan
    from trainer.plan.profiles import get_device
    from trainer.plan.search import fitting_option

    world = given_world(args) or job.plan.world_size or 1
    device = get_device(args.device or job.plan.device or "h100", args.device_memory_gib, world)
    dims = check_job(job, world)
    plan = make_plan(job, dims, device)
    if args.json:
        print(json.dumps(plan.to_json(), indent=1))
        return 0 if plan.fits else 1
    print(format_plan(plan, job))
    if not plan.fits:  # what train.py's check would say: the largest term, and what fits
        print(f"Does not fit: {plan.misfit(fitting_option(job, dims, device))}")
    return 0 if plan.fits else 1


def search_command(job, args) -> int:
    from trainer.plan.profiles import get_device
    from trainer.plan.search import format_search, search

    if not args.gpus or args.gpus < 1:
        raise ConfigError("--search needs --gpus N (N >= 1)")
    device = get_device(args.device or job.plan.device or "h100", args.device_memory_gib, args.gpus)
    if args.gpus_per_node:
        from dataclasses import replace

        device = replace(device, per_node=args.gpus_per_node)
    results = search(job, args.gpus, device)
    if args.json:
        print(json.dumps([plan.to_json() | {"overrides": overrides}
                          for plan, overrides in results[:args.top]],
                         indent=1))
    else:
        print(format_search(results[:args.top], job, args.gpus, device))
    return 0


def calibrate_command(job, args, overrides: list[str]) -> int:
    import dataclasses
    import datetime

    import torch

    from trainer.plan.calibrate import calibrate, ranking, torchrun_measure
    from trainer.plan.devices import measure_cpu, measure_cuda
    from trainer.plan.profiles import profile_path, save_profile

    if not args.name:
        raise ConfigError("--calibrate needs --name NAME: the profile it writes "
                          "(devices/NAME.json)")
    world = given_world(args) or torch.cuda.device_count() or 2
    # a timed matmul and NCCL all-reduce; its memory as CUDA reports it
    if torch.cuda.is_available():
        base = measure_cuda(world)
    else:  # one thread a rank, as torchrun runs them
        base = measure_cpu(world, threads=1 if world > 1 else None)
    base = dataclasses.replace(base, name=profile_path(args.name).stem)
    measure = torchrun_measure(overrides, world, args.steps)
    device, runs = calibrate(job, world, base, measure)
    record = {"command": " ".join(["python scripts/plan.py", *sys.argv[1:]]),
              "date": datetime.date.today().isoformat(), "torch": torch.__version__, "world": world,
              "runs": runs}
    e = device.efficiency
    print(f"{device.name}: bf16 {device.bf16_tflops:.3g} / fp32 {device.fp32_tflops:.3g} TFLOPs a "
          f"rank, links {device.intra_gbps:.3g} GB/s, {device.memory_gib:.1f} GiB; efficiency "
          f"alone {e.alone}, replicated {e.replicated}, with collectives {e.with_collectives}, tp "
          f"{e.tp}")
    for run in runs:
        print(f"  {run['share']:>16}: {run['layout']}: measured "
              f"{run['measured_tokens_per_s']:,.0f} tokens/s, plan "
              f"{run['predicted_tokens_per_s']:,.0f}")
    if args.rank:
        record["ranking"] = ranking(job, world, device, measure,
                                    {run["layout"]: run["measured_tokens_per_s"] for run in runs})
        print_ranking(record["ranking"])
    path = save_profile(device, args.name, record)
    print(f"written {path}: use it with plan.device={args.name} (train.py) or --device {args.name}")
    return 0


def rank_command(job, args, overrides: list[str]) -> int:
    """parallel=auto's pick against every other layout it considers, each run here: the figures it
    ranks with are auto's for this machine (--device or plan.device: a profile, else fixed
    figures)."""
    import torch

    from trainer.plan.auto import auto_device, for_search
    from trainer.plan.calibrate import ranking, torchrun_measure

    world = given_world(args) or torch.cuda.device_count() or 2
    kind = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = auto_device(kind, world, args.device or job.plan.device)
    job, cleared = for_search(job)
    cleared = [f"{key}=null" for key in cleared]
    print_ranking(ranking(job, world, device,
                          torchrun_measure([*overrides, *cleared], world, args.steps)))
    return 0


def print_ranking(rows: list[dict]) -> None:
    best = max(row["measured_tokens_per_s"] for row in rows)
    print(f"\nthe search's layouts, best predicted first (tokens/s; the chosen one "
          f"{rows[0]['measured_tokens_per_s'] / best - 1:+.1%} from the best measured):")
    for row in rows:
        print(f"  {row['predicted_tokens_per_s']:>10,.0f} predicted "
              f"{row['measured_tokens_per_s']:>10,.0f} measured  {row['layout']}")


def format_plan(plan, job) -> str:
    from trainer.optim.spec import optimizer_of
    from trainer.plan import GIB
    from trainer.plan.search import cp_split

    d = plan.dims
    t = job.training
    degrees = " ".join(f"{k}={getattr(d, k)}" for k in ("pp", "dp_replicate", "dp_shard", "cp",
                                                        "tp", "ep"))
    if d.cp > 1:
        degrees += f" | cp {cp_split(job.parallel.cp_method, d.cp_ulysses if d.cp_ring > 1 else 1)}"
    lines = [
        f"{job.model.name} on {plan.world_size} x {plan.device.name} ({plan.device.memory_gib:.0f} "
        f"GiB each) | {degrees}",
        f"batch {t.global_batch_size} x {t.seq_len} tokens, accumulation {d.grad_accum_steps}, "
        f"{d.pp_microbatches} pipeline microbatches, activation checkpointing "
        f"{t.activation_checkpoint}",
        "",
        f"{'pp rank':>7} | {'params':>7} | {'grads':>7} | {'optim':>7} | {'gathered':>8} | "
        f"{'activ.':>7} | {'buffers':>7} | {'peak GiB':>8}",
    ]
    for r in plan.ranks:
        values = [r.params, r.grads, r.optimizer, r.gathered, r.activations, r.buffers]
        lines.append(f"{r.pp_rank:>7} | " + " | ".join(f"{v / GIB:>7.2f}" for v in values[:3])
                     + f" | {values[3] / GIB:>8.2f} | {values[4] / GIB:>7.2f} | "
                       f"{values[5] / GIB:>7.2f} | "
                     + f"{r.peak / GIB:>8.2f}")
    usable = plan.device.memory_gib * 0.9
    verdict = "fits" if plan.fits else "does NOT fit"
    tm = plan.time
    offload = plan.ranks[0].offload
    lines += [
        "",
        f"peak {plan.peak / GIB:.1f} GiB of {usable:.1f} usable: {verdict}"
        + {"optimizer": " (params, grads and optim on the host)",
           "activations": " (activations but three blocks' on the host)"}.get(offload, ""),
        f"step {tm.step_s:.2f} s (compute {tm.compute_s:.2f}, attention {tm.attention_s:.2f} of "
        f"it, fsdp {tm.fsdp_s:.2f} overlapped, tp {tm.tp_s:.2f}, cp {tm.cp_s:.2f}, ep "
        f"{tm.ep_s:.2f}, pp {tm.pp_s:.2f}, bubble {100 * tm.bubble:.0f}%)",
        f"{plan.tokens_per_s:,.0f} tokens/s, MFU {100 * plan.mfu:.1f}%",
    ]
    if plan.host_per_node:
        lines.append(f"host: {plan.host_per_node / GIB:.1f} GiB a node of "
                     f"{plan.host_memory_gib:.0f} (plan.host_memory_gib); its link "
                     f"{tm.host_s:.2f} s a step beside fsdp's")
    if tm.optimizer_s:
        work = ("the step on the host" if offload == "optimizer"
                else optimizer_of(job.optim).step_work)
        lines.append(f"optimizer: {tm.optimizer_s:.2f} s of the step "
                     f"({100 * tm.optimizer_s / tm.step_s:.1f}%: {work}), in the step above")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
