"""The layout: degree inference, each of its rules (trainer/checks/job.py), and the mesh with its
views."""

import dataclasses

import pytest
from helpers import spawn

from trainer.checks.job import check_job, resolve_layout
from trainer.config.schema import JobConfig
from trainer.errors import ConfigError
from trainer.models import model_config
from trainer.parallel.dims import ParallelDims


def job_for(**settings) -> JobConfig:
    """The default job with `settings`: parallel keys by name, others as section__key."""
    job = JobConfig()
    job.training.seq_len, job.training.global_batch_size = 128, 8
    model = {key.split("__")[1]: value for key, value in settings.items()
             if key.startswith("model__")}
    if "n_experts" in model:
        model["family"] = "mixtral"
    job.model = model_config({**dataclasses.asdict(job.model), **model})
    for key, value in settings.items():
        section, name = key.split("__") if "__" in key else ("parallel", key)
        if section != "model":
            setattr(getattr(job, section), name, value)
    return job


def dims_for(world: int, **settings) -> ParallelDims:
    job = job_for(**settings)
    return resolve_layout(job.parallel, job.model, job.training, world)


def test_rules_that_only_bind_with_the_feature_on():
    dims_for(4, tp=2, loss_parallel=False, model__vocab_size=2049)
    dims_for(4, tp=4, sequence_parallel=False, training__seq_len=130)
    dims_for(4, cp=1, cp_method="ulysses", training__seq_len=130)  # (a misspelt one: an error)
    dims_for(4, cp=2, tp=2, sequence_parallel=False, training__seq_len=132)


def test_ulysses_degree_is_all_of_cp_or_the_hybrids_inner_part():
    assert dims_for(4, cp=4, cp_method="ulysses").cp_ulysses == 4
    assert dims_for(4, cp=4).cp_ulysses == 1
    hybrid = dims_for(8, cp=4, cp_ulysses=2)
    assert (hybrid.cp_ring, hybrid.cp_ulysses, hybrid.dp_shard) == (2, 2, 2)


def test_pipeline_degrees_are_derived_from_the_schedule():
    dims = dims_for(4, pp=2, pp_schedule="1f1b")
    assert (dims.pp_stages_per_rank, dims.pp_microbatches, dims.dp_shard) == (1, 2, 2)
    dims = dims_for(2, pp=2, pp_schedule="interleaved_zb")
    assert (dims.pp_stages_per_rank, dims.pp_microbatches) == (2, 4)
    dims_for(2, pp=2, pp_stage_modules=[["tok_embeddings", *[f"layers.{i}" for i in range(5)]],
                                        [*[f"layers.{i}" for i in range(5, 8)], "norm", "output"]])


def test_ep_takes_the_data_parallel_ranks():
    assert dims_for(8, ep=-1).ep == 1  # a dense model has no experts to split
    assert dims_for(8, ep=-1, model__n_experts=8).ep == 8
    assert dims_for(8, ep=-1, cp=2, tp=2, model__n_experts=8).ep == 4  # dp_shard 2 x cp 2, not tp


def test_dp_shard_takes_the_rest():
    assert dims_for(8).dp_shard == 8
    dims = dims_for(8, dp_replicate=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp) == (2, 4, 8)
    assert dims.dp_replicate_enabled and dims.dp_shard_enabled and not dims.tp_enabled


def test_an_elastic_layout_follows_the_world_and_keeps_the_global_batch():
    """dp_replicate=-1 (or dp_shard=-1) takes up the ranks; micro_batch_size fixes each rank's
    batch, so the accumulation makes up the global batch on whatever world a restart finds."""
    for world, replicas, accum in ((8, 4, 1), (4, 2, 2), (2, 1, 4)):
        job = job_for(dp_replicate=-1, dp_shard=2, training__micro_batch_size=1,
                      training__grad_accum_steps=8)
        dims = resolve_layout(job.parallel, job.model, job.training, world)
        assert (dims.dp_replicate, dims.dp_shard, dims.grad_accum_steps) == (replicas, 2, accum)


@pytest.mark.parametrize(
    "world, settings, message",
    [
        (4, {"dp_replicate": -1, "dp_shard": -1},
         r"parallel.dp_replicate=-1 and parallel.dp_shard=-1: only one of them"),
        (6, {"dp_replicate": -1, "dp_shard": 4},
         r"parallel.dp_replicate=-1 needs the world size 6 to be divisible by "
         r"pp\*dp_shard\*cp\*tp=4"),
        (4, {"tp": 2, "dp_shard": 4},
         r"tp=2\); for a job whose world size can change \(an elastic launch, a restart on fewer "
                                      r"or more nodes\), set parallel.dp_shard=-1 or "
                                      r"parallel.dp_replicate=-1$"),
        (4, {"training__micro_batch_size": 3},
         r"training.global_batch_size=8 must be divisible by dp\*micro_batch_size=12"),
        (4, {"dp_replicate": 3},
         r"parallel.dp_shard=-1 needs the world size 4 to be divisible by "
         r"pp\*dp_replicate\*cp\*tp=3"),
        (4, {"dp_replicate": 2, "dp_shard": 3},
         r"parallel: pp\*dp_replicate\*dp_shard\*cp\*tp=6 must equal the world size 4"),
        (4, {"tp": 3}, r"parallel.tp=3 must divide model.n_heads=16"),
        (4, {"tp": 16, "model__n_heads": 32}, r"parallel.tp=16 must divide model.n_kv_heads=8"),
        (4, {"tp": 2, "model__ffn_dim": 769}, r"parallel.tp=2 must divide model.ffn_dim=769"),
        (4, {"pp": 9}, r"parallel.pp=9 must not exceed model.n_layers=8"),
        (4, {"pp_schedule": "zigzag"}, r"parallel.pp_schedule=zigzag is unknown"),
        (4, {"cp": 3}, r"parallel.cp=3 needs training.seq_len=128 divisible by 2\*cp=6"),
        (4, {"cp": 2, "training__seq_len": 130},
         r"parallel.cp=2 needs training.seq_len=130 divisible by 2\*cp=4"),
        (4, {"cp": 2, "cp_method": "flash"},
         r"parallel.cp_method=flash is unknown; choose one of \['ring', 'allgather', 'ulysses'\]"),
        # Ulysses splits the heads a tp rank holds (16 / tp 4 = 4 here); the hybrid's Ulysses part
        # divides cp
        (8, {"cp": 8, "cp_method": "ulysses", "model__n_heads": 12, "model__n_kv_heads": 4,
             "model__dim": 384},
         r"parallel.cp=8 must divide the attention heads it splits, model.n_heads=12; nearest "
         r"that work: parallel.cp=6 or parallel.cp=12, or the hybrid parallel.cp_method=ring "
         r"parallel.cp_ulysses=4"),
        (8, {"cp": 2, "tp": 4, "cp_ulysses": 2, "model__n_heads": 4, "model__n_kv_heads": 4,
             "model__dim": 256},
         r"parallel.cp_ulysses=2 must divide the attention heads it splits, model.n_heads=4 / "
         r"parallel.tp=4 = 1"),
        (4, {"cp": 4, "cp_ulysses": 3}, r"parallel.cp_ulysses=3 must divide parallel.cp=4 \(cp = "
         r"ring ranks x Ulysses ranks\)"),
        (4, {"cp": 4, "cp_method": "ulysses", "cp_ulysses": 2},
         r"parallel.cp_method=ulysses spans all parallel.cp=4 ranks, not parallel.cp_ulysses=2"),
        (4, {"cp_ulysses": 2}, r"parallel.cp_ulysses=2 is the Ulysses part of parallel.cp=1"),
        (4, {"cp": 2, "tp": 2, "training__seq_len": 132},
         r"parallel.tp=2 x 2\*cp=4 must divide training.seq_len=132 when "
         r"parallel.sequence_parallel=true"),
        (4, {"training__seq_len": 4096},
         r"training.seq_len=4096 must not exceed model.max_seq_len=2048"),
        (4, {"training__global_batch_size": 6},
         r"training.global_batch_size=6 must be divisible by dp\*grad_accum_steps=4"),
        (2, {"training__grad_accum_steps": 3},
         r"training.global_batch_size=8 must be divisible by dp\*grad_accum_steps=6"),
        (4, {"tp": 2, "model__vocab_size": 2049},
         r"parallel.tp=2 must divide model.vocab_size=2049 when parallel.loss_parallel=true"),
        (4, {"tp": 4, "training__seq_len": 130},
         r"parallel.tp=4 must divide training.seq_len=130 when parallel.sequence_parallel=true"),
        (4, {"tp": 2, "model__tie_embeddings": True},
         r"parallel.tp=2 needs model.tie_embeddings=false"),
        (2, {"pp": 2, "pp_schedule": "zbv", "pp_stages_per_rank": 3},
         r"parallel.pp_stages_per_rank=3 must be 2 for parallel.pp_schedule=zbv"),
        (2, {"pp": 2, "pp_schedule": "gpipe", "pp_stages_per_rank": 2},
         r"parallel.pp_stages_per_rank=2 must be 1 for parallel.pp_schedule=gpipe"),
        (4, {"pp": 4, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 3},
         r"12 stages must not exceed model.n_layers=8: every stage needs a layer"),
        (2, {"pp": 2, "model__tie_embeddings": True},
         r"parallel.pp=2 needs model.tie_embeddings=false"),
        (2, {"pp": 2, "pp_microbatches": 3},
         r"parallel.pp_microbatches=3 must divide the batch each pipeline step runs, "
         r"global_batch_size/\(dp\*grad_accum_steps\)=8"),
        (4, {"pp": 4, "pp_schedule": "interleaved_1f1b", "pp_microbatches": 2},
         r"parallel.pp_microbatches=2 must be >= 4 for parallel.pp_schedule=interleaved_1f1b"),
        (4, {"pp": 4, "pp_schedule": "1f1b", "pp_microbatches": 2},
         r"parallel.pp_microbatches=2 must be >= 4 for parallel.pp_schedule=1f1b"),
        (2, {"pp": 2, "pp_schedule": "dualpipev", "pp_microbatches": 2},
         r"parallel.pp_microbatches=2 must be >= 4 for parallel.pp_schedule=dualpipev with 4 "
         r"stages"),
        (2, {"pp": 2, "pp_stage_modules": [["tok_embeddings", "layers.0"],
                                           ["layers.2", "norm", "output"]]},
         r"parallel.pp_stage_modules must be 2 lists"),
        (4, {"ep": 2}, r"parallel.ep=2 needs a mixture-of-experts model \(model.n_experts > 0\)"),
        (4, {"ep": 3, "model__n_experts": 8}, r"parallel.ep=3 must divide model.n_experts=8"),
        (4, {"ep": 8, "model__n_experts": 8},
         r"parallel.ep=8 must divide the ranks it is taken from, dp_shard\*cp=4"),
        (4, {"tp": 0}, r"parallel.tp=0 must be >= 1"),
        (4, {"tp": -1}, r"parallel.tp=-1 must be >= 1"),
    ],
)
def test_rule_gives_a_config_error(world, settings, message):
    with pytest.raises(ConfigError, match=message):
        dims_for(world, **settings)


@pytest.mark.parametrize("settings, message", [
    ({"training__activation_checkpoint": "some"},
     r"training.activation_checkpoint=some must be one of \['none', 'full', 'selective'\]"),
    ({"training__activation_checkpoint_every": 0},
     r"training.activation_checkpoint_every=0 must be >= 1"),
    ({"training__micro_batch_size": 0}, r"training.micro_batch_size=0 must be >= 1"),
    ({"pp": 2, "pp_schedule": "zbv", "training__activation_checkpoint": "selective"},
     r"training.activation_checkpoint=selective cannot be combined with parallel.pp_schedule=zbv"),
    ({"distributed__timeout_s": 0}, r"distributed.timeout_s=0 must be > 0 seconds"),
    ({"distributed__step_timeout_s": -5},
     r"distributed.step_timeout_s=-5 must be null \(no watchdog\) or > 0 seconds"),
    ({"optim__name": "sgd"}, r"optim.name=sgd is unknown; choose one of \['adamw', .*'muon'.*\]"),
])
def test_checkpointing_and_timeout_rules_give_a_config_error(settings, message):
    with pytest.raises(ConfigError, match=message):
        check_job(job_for(**settings), 2)


def test_an_unknown_device_is_a_config_error():
    job = job_for()
    job.device = "tpu"
    with pytest.raises(ConfigError, match=r"^device=tpu is unknown; choose auto, cpu or cuda$"):
        check_job(job, 2)


def _check_meshes(rank, world_size):
    # Degrees in mesh order pp, dp_replicate, dp_shard, cp, tp; built directly, as later
    # parallelisms will, so every dimension is exercised.
    for pp, rep, shard, cp, tp in [(1, 1, 8, 1, 1), (1, 2, 4, 1, 1), (2, 2, 1, 1, 2),
                                   (1, 2, 1, 2, 2), (2, 1, 2, 2, 1)]:
        dims = ParallelDims(dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, pp=pp, ep=1,
                            world_size=world_size)
        mesh = dims.build_mesh("cpu")
        assert mesh.shape == (pp, rep, shard, cp, tp)
        assert mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        sizes = {name: dims.view(name).size() for name in ("dp", "dp_shard_cp", "dp_cp", "tp",
                                                           "pp")}
        assert sizes == {"dp": rep * shard, "dp_shard_cp": shard * cp, "dp_cp": rep * shard * cp,
                         "tp": tp, "pp": pp}
        # Row-major layout: tp ranks are neighbours, pp ranks are world_size/pp apart.
        coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
        assert dims.view("tp").mesh.tolist() == [rank - coords["tp"] + i for i in range(tp)]
        assert dims.view("pp").mesh.tolist() == [rank % (world_size // pp) + i * (world_size // pp)
                                                 for i in range(pp)]
        # Every rank of a dp group shares its pp, cp and tp coordinates.
        stride = cp * tp
        assert dims.view("dp").mesh.tolist() == [
            rank - (coords["dp_replicate"] * shard + coords["dp_shard"]) * stride + i * stride
            for i in range(rep * shard)
        ]
        # FSDP shards over dp_shard x cp; HSDP adds the replicas as an outer dimension.
        fsdp = dims.fsdp_mesh
        assert fsdp.shape == ((rep, shard * cp) if rep > 1 else (shard * cp,))
        assert fsdp.mesh_dim_names[-1] == "dp_shard_cp"


@pytest.mark.multiprocess
def test_mesh_dims_and_views_on_eight_ranks():
    spawn(_check_meshes, 8, timeout=240)


def test_the_mesh_line_names_the_expert_degree():
    from trainer.observe.describe import describe_layout

    dims = ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=1, pp=1, ep=2, world_size=4, moe=True)
    assert (describe_layout(dims)
            == "mesh pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=1 (ep=2 over dp_shard x cp)")
    assert describe_layout(dataclasses.replace(dims, ep=1)).endswith("tp=1")
