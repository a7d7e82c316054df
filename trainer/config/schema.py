"""The configuration schema: every key, its type and default (registered with Hydra by
trainer/config/files.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, List, Optional


@dataclass
class RopeScaling:
    """Rotary frequency scaling, for contexts beyond the one pretrained (Hugging Face's rope_type).

    llama3 (Llama 3.1): rotary wavelengths longer than original_max_seq_len / low_freq_factor are
    stretched by `factor`, those shorter than original_max_seq_len / high_freq_factor are kept, and
    the ones between are blended. yarn (DeepSeek-V3, Qwen3's long context): the frequencies that
    turn fewer than beta_slow times over original_max_seq_len are divided by `factor`, those that
    turn more than beta_fast times kept, a linear ramp between; cos and sin are scaled by an
    attention factor from `factor`, `mscale` and `mscale_all_dim` (which a family's attention may
    also apply to its softmax scale, as DeepSeek's does)."""

    type: str = "llama3"  # llama3 | yarn
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


def shape(default):
    """A model key that fixes what the weights are (their shapes, or what they mean): a checkpoint
    saved with another value of it cannot be loaded, or resumed."""
    return field(default=default, metadata={"shape": True})


@dataclass
class ModelConfig:
    """The keys every decoder family shares. A family adds its own keys in a subclass it registers
    (its `config`), set the same way, model.<key>=...; see trainer/models/README.md."""

    family: str = shape("llama")
    name: str = "llama_debug"
    dim: int = shape(256)
    n_layers: int = shape(8)
    n_heads: int = shape(16)
    n_kv_heads: int = shape(8)
    vocab_size: int = shape(2048)
    ffn_dim: int = shape(768)
    norm_eps: float = shape(1e-5)
    rope_theta: float = shape(10000.0)
    rope_scaling: Optional[RopeScaling] = None  # null: plain rotary embeddings
    max_seq_len: int = 2048
    tie_embeddings: bool = shape(False)


def shape_keys(model: ModelConfig) -> list[str]:
    """The keys of `model` (its family's included) that a checkpoint must agree on."""
    return [f.name for f in fields(model) if f.metadata.get("shape")]


@dataclass
class ParallelConfig:
    # true (parallel=auto): the degrees below, the pipeline schedule, the checkpointing mode and the
    # accumulation are chosen at launch by the plan's
    # search; those given on the command line are kept.
    auto: bool = False
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    pp_schedule: str = "1f1b"
    # null: one microbatch per pipeline stage.
    pp_microbatches: Optional[int] = None
    pp_stages_per_rank: Optional[int] = None
    # What the embedding and the output head weigh, in layers, when stages are balanced.
    pp_embedding_cost: float = 1.0
    pp_output_cost: float = 1.0
    # An explicit split overriding the balanced one: module names per stage, e.g.
    # [[tok_embeddings, layers.0, ...], [..., layers.7, norm, output]].
    pp_stage_modules: Optional[List[List[str]]] = None
    # How attention spans the cp ranks: ring (K/V passed around, O(seq/cp) memory) | allgather |
    # ulysses (all-to-all: the whole sequence for 1/cp of the heads).
    cp_method: str = "ring"
    # The hybrid: Ulysses over groups of this many neighbouring cp ranks, cp_method (ring or
    # allgather) across the groups. 1: no Ulysses; cp_method=ulysses: all of cp.
    cp_ulysses: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = True


@dataclass
class MixedPrecisionConfig:
    # "auto": bfloat16 on CUDA, float32 on CPU.
    param_dtype: str = "auto"
    reduce_dtype: str = "float32"


@dataclass
class SpikeConfig:
    # null: off. Else a loss above its running mean by
    # this many running standard deviations is a spike.
    threshold: Optional[float] = None
    # skip: the step is skipped | rollback: back to the newest checkpoint, past the data
    action: str = "skip"
    warmup_steps: int = 50  # steps whose losses only feed the running mean and variance
    # of the running mean and variance, per step (about 1 / (1 - decay) steps of memory)
    decay: float = 0.95


@dataclass
class Float8Config:
    """float8 linear layers through torchao (pip install -e ".[float8]")."""

    enabled: bool = False
    recipe: str = "tensorwise"  # tensorwise | rowwise | rowwise_with_gw_hp (torchao's recipes)
    # float8 casts with high-precision matmuls (a GPU before sm_89, or checking numerics)
    emulate: bool = False
    # Module names (fnmatch patterns) whose linear layers
    # stay in high precision; the output head always does.
    skip: List[str] = field(default_factory=lambda: ["*.router"])
    # Layers with a dimension that is not a multiple of 16 stay in high precision (named at
    # start-up); false: a config error names them.
    skip_unaligned: bool = True


@dataclass
class TrainingConfig:
    steps: int = 1000
    seq_len: int = 2048
    global_batch_size: int = 8
    grad_accum_steps: int = 1
    # Sequences per data-parallel rank in one forward-backward; set, grad_accum_steps is derived
    # from it and the global batch instead (more accumulation
    # on fewer ranks: what an elastic job wants).
    micro_batch_size: Optional[int] = None
    lr: float = 3e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    max_norm: float = 1.0
    seed: int = 0
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    compile: bool = False
    # On the CPU, large freed blocks stay in the process for reuse (see trainer/run/allocator.py).
    cpu_reuse_memory: bool = True
    # none | full | selective; under full, every Nth block is checkpointed (1: every block).
    activation_checkpoint: str = "none"
    activation_checkpoint_every: int = 1
    # What selective keeps of a block's matmul outputs:
    # half_mm (every second one) | ops (all of them).
    selective_policy: str = "half_mm"
    # What lives in host memory: none | optimizer (the sharded fp32 weights, their gradients and the
    # optimizer's state; the optimizer steps on the host, FSDP copies each unit's shard to the
    # device to gather it).
    offload: str = "none"
    # The output head and the loss are computed this many tokens at a time, so that the logits of at
    # most one chunk exist (null: the plain loss on a microbatch's whole logits, for reference).
    loss_chunk_tokens: Optional[int] = 2048
    # A step whose loss or gradient norm is NaN or infinite: skip (no optimizer step) | stop.
    on_nonfinite: str = "skip"
    max_skipped_steps: int = 10  # skipped steps in a row that stop the job (0: no limit)
    spike: SpikeConfig = field(default_factory=SpikeConfig)


@dataclass
class OptimConfig:
    """The keys every optimizer shares; one with keys of its own subclasses this (optim=muon:
    trainer/optim/muon.py's MuonConfig), and its config class types the composed section."""

    # a registered optimizer: adamw | muon (Muon for the blocks' matrices, AdamW for the rest)
    name: str = "adamw"
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # The cosine schedule decays to lr * min_lr_ratio at the last step.
    min_lr_ratio: float = 0.1
    # The dtype of the optimizer's state (AdamW's moments): float32 | bfloat16 (half the bytes,
    # stored by stochastic rounding; the master weights stay fp32).
    state_dtype: str = "float32"


@dataclass
class MixSource:
    """One source of a weighted mixture: read like data.source/path/... (the tokenizer is
    data's)."""

    source: str = "text"
    path: Optional[str] = None
    text_field: str = "text"
    subset: Optional[str] = None
    split: str = "train"
    weight: float = 1.0  # relative: the shares are the weights over their sum


@dataclass
class DataConfig:
    source: str = "embedded"  # embedded | text | json | parquet | hub | binary
    path: Optional[str] = None  # a glob of files; a Hub dataset's name (hub); a token file (binary)
    # auto: the tokenizer beside checkpoint.initial's weights, else bytes | bytes | a tokenizer.json
    # or a directory holding one
    tokenizer: str = "auto"
    text_field: str = "text"  # the column holding the text (json, parquet, hub)
    subset: Optional[str] = None  # a Hub dataset's configuration name
    split: str = "train"  # the Hub dataset's split to train on
    document_mask: bool = False  # attention stays within each document of a packed window
    # Where text/json/parquet sources are kept once tokenized; null: $TRAINER_CACHE/tokens, else
    # ~/.cache/trainer/tokens. Shared by the ranks (a shared filesystem: one rank tokenizes).
    cache_dir: Optional[str] = None
    # A weighted mixture instead of data.source/path:
    # [{source: text, path: 'web/*.txt', weight: 0.7}, ...]
    mix: List[MixSource] = field(default_factory=list)
    # Undecodable bytes, malformed JSON lines, empty files and rows without data.text_field: counted
    # and passed over (false), or a config error at the first one (true).
    strict: bool = False
    # text: documents, every token a target | chat: rows of messages through the chat template, the
    # loss on the assistant's turns | completion: prompt/completion rows, the loss on the completion
    format: str = "text"
    messages_field: str = "messages"  # chat: the column holding [{role, content}, ...]
    prompt_field: str = "prompt"  # completion
    completion_field: str = "completion"  # completion
    # a Jinja file; null: the tokenizer's tokenizer_config.json chat_template
    chat_template: Optional[str] = None
    # chat/completion: conversations packed whole into
    # windows (attention within each), or one a window
    pack: bool = True
    # chat/completion: a conversation longer than a window is truncated | dropped
    overlong: str = "truncate"


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "trainer"
    # "offline" writes under output_dir and needs no network; "online" uploads.
    mode: str = "offline"


@dataclass
class TensorBoardConfig:
    # every figure of metrics.jsonl as scalars, under output_dir/tensorboard (rank 0)
    enabled: bool = False


@dataclass
class MetricsConfig:
    log_every: int = 10
    # null: unknown (mfu is null on CPU); a number in TFLOP/s per device; "auto": time a matmul.
    peak_tflops: Optional[Any] = None
    # A step to record with torch's profiler on every rank (output_dir/profile/); null: none.
    profile_step: Optional[int] = None
    # A step whose CUDA allocator history to record (from the step before it) into
    # output_dir/memory/, with the tensors live at its peak by origin; null: none. CUDA only.
    memory_snapshot_step: Optional[int] = None
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    # Straggler detection (trainer/observe/health.py): every `health_every` steps (null: never) the
    # ranks' phase times over the last `slow_rank_window` steps are compared; a rank whose step
    # would take more than `slow_rank_threshold` times the median rank's is named.
    health_every: Optional[int] = 5
    slow_rank_window: int = 10
    slow_rank_threshold: float = 1.25


@dataclass
class ValidationConfig:
    every: int = 0  # steps between validations; 0: never
    steps: int = 4  # global batches per validation
    # Files to validate on (read like data.path, with data's source and tokenizer); null holds out
    # the last windows of the training data instead.
    path: Optional[str] = None


@dataclass
class PlanConfig:
    check: bool = True  # refuse a job the memory plan predicts will not fit the device
    # The hardware a recipe is sized for: scripts/plan.py's defaults for --device and --world.
    device: Optional[str] = None
    world_size: Optional[int] = None
    # GiB of host memory a node has for what training.offload puts there (null: the machine's at
    # launch, the device table's node in scripts/plan.py).
    host_memory_gib: Optional[float] = None


@dataclass
class CheckpointConfig:
    enabled: bool = False
    interval: int = 500  # save every `interval` steps, and at the last step
    keep_last: int = 3  # 0 keeps every checkpoint
    resume: str = "auto"  # auto: the newest complete checkpoint in output_dir, if any | none | PATH
    async_save: bool = False  # training waits only while the state is copied to host memory
    # weights to start from: a seed checkpoint, ours or a Hugging Face directory
    initial: Optional[str] = None
    # Resume output_dir's checkpoints although model, data, optimizer or batch settings changed.
    allow_config_change: bool = False


@dataclass
class DistributedConfig:
    # Seconds a collective may wait before it fails (every process group, gloo and NCCL); also how
    # long the watchdog allows the first step (compilation,
    # warm-up), a checkpoint save or a validation.
    timeout_s: int = 1800
    # Seconds any later step may take before the watchdog reports where each rank is and exits
    # non-zero (null: no watchdog).
    step_timeout_s: Optional[float] = 600


@dataclass
class FaultToleranceConfig:
    """Per-step fault tolerance across replica groups (torchft): each of the parallel.dp_replicate
    groups is a job of its own (dp_shard x cp x tp x pp ranks); a lighthouse keeps them in step."""

    enabled: bool = False
    replica_group: int = 0  # this job's group: 0 .. parallel.dp_replicate - 1
    lighthouse: Optional[str] = None  # http://host:29510; null: $TORCHFT_LIGHTHOUSE
    min_replicas: int = 1  # a step commits only with at least this many groups in it
    timeout_s: float = 60  # a collective across groups, or a recovery from a peer, before it fails
    quorum_timeout_s: float = 60  # waiting for the groups to agree on a step
    # While groups are out the survivors train the missing groups' shares too, so every step trains
    # the whole global batch in the same order; false: the step trains the survivors' shares only.
    keep_global_batch: bool = True


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning: the base weights frozen, small adapters trained (the keys
    and names of Hugging Face peft's LoraConfig)."""

    method: Optional[str] = None  # null: every weight trains | lora
    rank: int = 8  # the adapters' rank (peft's r)
    alpha: float = 16.0  # the adapters' product is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input, in training
    # fnmatch patterns of the linear layers that take adapters (a name without a dot matches a
    # layer's last part: wq); null: the family's (the attention and feed-forward projections)
    target_modules: Optional[List[str]] = None
    # how the frozen weights of the layers with adapters are held: null (the compute dtype) | nf4
    # (QLoRA: 4-bit NormalFloat, torchao's)
    base_dtype: Optional[str] = None


@dataclass
class JobConfig:
    device: str = "auto"
    run_name: str = "${recipe_name:}"
    output_dir: str = "outputs/${run_name}"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    # Python modules every rank imports first: model
    # families defined outside trainer/ register there.
    imports: List[str] = field(default_factory=list)
