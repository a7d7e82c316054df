"""Input files of the wrong kind, and converter mistakes: each one `config error:` naming the file
and what to do, never a traceback from the library underneath."""

import dataclasses
import json
import re
import runpy
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import NEEDS_TORCHAO, NEEDS_TORCHFT

from trainer.checkpoint.hf import config_from_hf
from trainer.config.schema import DataConfig
from trainer.data import build_dataset
from trainer.data.packed import SCANNED_TOKENS
from trainer.data.readers import Problems, documents
from trainer.data.tokenizer import build_tokenizer
from trainer.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import convert_hf  # noqa: E402


def test_a_tokenizer_file_that_is_not_a_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text("not json at all")
    with pytest.raises(ConfigError,
                       match=r"^data.tokenizer=.*tokenizer.json is not a tokenizer the tokenizers"):
        build_tokenizer(str(tmp_path))


def test_a_parquet_source_that_is_not_parquet(tmp_path):
    (tmp_path / "a.parquet").write_text("hello, I am text")
    # empty: counted and passed over, like an empty text file
    (tmp_path / "b.parquet").write_bytes(b"")
    with pytest.raises(ConfigError,
                       match=r"a.parquet is not a parquet file \(data.source=parquet\)"):
        list(documents("parquet", str(tmp_path / "*.parquet")))


QWEN3 = {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10,
         "intermediate_size": 8, "rms_norm_eps": 1e-6, "head_dim": 8}


@pytest.mark.parametrize("config, message", [
    (None, r"is not a Hugging Face model directory: it has no config.json"),
    ("{not json", r"config.json is not JSON"),
    ({"model_type": "llama", "num_hidden_layers": 2},
     r"config.json lacks hidden_size, num_attention_heads"),
    ({"model_type": "gpt2", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
      "vocab_size": 10,
      "intermediate_size": 8, "rms_norm_eps": 1e-5},
     r"model_type=gpt2 is not supported \(deepseek_v3, llama, "
                                                      r"mixtral, qwen3, qwen3_moe\)"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForSequenceClassification"], **QWEN3},
     r"architectures=\['Qwen3ForSequenceClassification'\] is not supported \(Qwen3ForCausalLM"),
    ({"model_type": "qwen3", "use_sliding_window": True, **QWEN3},
     r"use_sliding_window=True is not supported"),
    ({"model_type": "qwen3_moe", "decoder_sparse_step": 2, "num_experts": 4,
      "num_experts_per_tok": 2,
      "moe_intermediate_size": 8, **QWEN3},
     r"dense layers between the sparse ones \(decoder_sparse_step"),
    ({"model_type": "mixtral", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
      "vocab_size": 10,
      "intermediate_size": 8, "rms_norm_eps": 1e-5},
     r"config.json lacks num_local_experts: not a mixtral config"),
])
def test_a_hugging_face_directory_that_is_not_one(tmp_path, config, message):
    if config is not None:
        (tmp_path / "config.json").write_text(config if isinstance(config, str)
                                              else json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        config_from_hf(tmp_path)


def test_the_converter_says_one_config_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        convert_hf.main(["from-hf", str(tmp_path / "missing"), str(tmp_path / "out")])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert (err.startswith("config error: ") and err.count("\n") == 1
            and "missing is not a Hugging Face model" in err)
    (tmp_path / "notes").mkdir()  # a folder, not a checkpoint: said so (it asked for --model)
    with pytest.raises(SystemExit) as stop:
        convert_hf.main(["to-hf", str(tmp_path / "notes"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"config error: {tmp_path / 'notes'} is not a checkpoint of this "
                          "trainer: a checkpoint is a folder holding manifest.json"), err


def run_train(argv: list[str]) -> int:
    """train.py as `python train.py ARGV` runs it, in this process: its exit status."""
    sys.argv = [str(REPO / "train.py"), *argv]
    try:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    except SystemExit as e:
        return e.code
    return 0


def _bad_tokenizer(tmp_path: Path) -> str:
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("not json")
    return str(tmp_path / "tok")


def _text_file(tmp_path: Path, name: str = "a.txt") -> str:
    (tmp_path / name).write_text("To be, or not to be, that is the question.\n" * 50)
    return str(tmp_path / name)


EVERY_TURN = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _chat(tmp_path: Path, row: dict | None = None,
          template: str | None = "{{ messages[0]['content'] }}", empty: bool = False) -> list[str]:
    """Overrides for chat data of one row (a good one by default; none if `empty`) and a template
    file (None: none)."""
    row = row or {"messages": [{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "hello"}]}
    (tmp_path / "chat.jsonl").write_text("" if empty else json.dumps(row) + "\n")
    overrides = ["data.source=json", f"data.path={tmp_path / 'chat.jsonl'}", "data.format=chat"]
    if template is not None:
        (tmp_path / "template.jinja").write_text(template)
        overrides.append(f"data.chat_template={tmp_path / 'template.jinja'}")
    return overrides


# name: (the overrides, given tmp_path; what the one line must say)
MISTAKES = {
    "negative lr": (lambda p: ["training.lr=-1"], r"training.lr=-1.0 must be >= 0"),
    "tensorboard without its package": (lambda p: ["metrics.tensorboard.enabled=true"],
                                        r"metrics.tensorboard.enabled=true needs the tensorboard "
                                        r"package: pip install"),
    "no health interval": (lambda p: ["metrics.health_every=0"],
                           r"metrics.health_every=0 must be >= 1, or null"),
    "a slow-rank threshold of 1": (lambda p: ["metrics.slow_rank_threshold=1"],
                                   r"metrics.slow_rank_threshold=1.0 must be > 1"),
    "zero batch": (lambda p: ["training.global_batch_size=0"],
                   r"training.global_batch_size=0 must be >= 1"),
    "beta2 above one": (lambda p: ["optim.beta2=1.5"], r"optim.beta2=1.5 must be in \[0, 1\)"),
    "an unknown optimizer state dtype": (lambda p: ["optim.state_dtype=int8"],
                                         r"optim.state_dtype=int8 is unknown; choose one of "
                                         r"\['float32', 'bfloat16', 'float8'\]"),
    "float8 state for Muon": (lambda p: ["optim=muon", "optim.state_dtype=float8"],
                              r"optim.state_dtype=float8 is not optim.name=muon's; it takes "
                              r"\['float32', 'bfloat16'\]"),
    "an unknown offload": (lambda p: ["training.offload=gradients"],
                           r"training.offload=gradients must be one of \['none', 'optimizer', "
                           r"'activations'\]"),
    "no host memory": (lambda p: ["plan.host_memory_gib=0"],
                       r"plan.host_memory_gib=0.0 must be > 0 GiB, or null"),
    "optimizer offload with Muon": (lambda p: ["optim=muon", "training.offload=optimizer"],
                                    r"training.offload=optimizer cannot be combined with "
                                    r"optim.name=muon: its collectives"),
    "optimizer offload with float8": (lambda p: ["training.offload=optimizer",
                                                 "training.float8.enabled=true"],
                                      r"training.offload=optimizer cannot be combined with "
                                      r"training.float8.enabled=true"),
    "activation offload with checkpointing": (lambda p: ["training.offload=activations",
                                                         "training.activation_checkpoint=full"],
                                              r"training.offload=activations cannot be combined "
                                              r"with training.activation_checkpoint=full: a "
                                              r"checkpointed block keeps only"),
    "unknown optimizer": (lambda p: ["optim=sgd"],
                          r"optim=sgd is not a known optim; choose one of \['adamw', 'muon'"),
    "unknown optimizer name": (lambda p: ["optim.name=adafactor"],
                               r"optim.name=adafactor is unknown; choose one of \['adamw', "
                               r".*'muon'.*\]"),
    "Muon's key under AdamW": (lambda p: ["optim.ns_steps=3"],
                               r"optim.ns_steps is not a config key \(of optim.name=adamw\); it is "
                               r"optim=muon's"),
    "no Newton-Schulz step": (lambda p: ["optim=muon", "optim.ns_steps=0"],
                              r"optim.ns_steps=0 must be >= 1"),
    "Muon momentum of one": (lambda p: ["optim=muon", "optim.momentum=1.0"],
                             r"optim.momentum=1.0 must be in \[0, 1\)"),
    "unknown RMS rule": (lambda p: ["optim=muon", "optim.muon.rms_match=spectral"],
                         r"optim.muon.rms_match=spectral must be one of \['match_rms_adamw', "
                         r"'original'\]"),
    "unknown Newton-Schulz dtype": (lambda p: ["optim=muon", "optim.ns_dtype=float16"],
                                    r"optim.ns_dtype=float16 must be one of \['auto', 'float32', "
                                    r"'bfloat16'\]"),
    "zero dim": (lambda p: ["model.dim=0"], r"model.dim=0 must be >= 1"),
    "unknown selective policy": (lambda p: ["training.activation_checkpoint=selective",
                                            "training.selective_policy=some"],
                                 r"training.selective_policy=some must be one of \['half_mm', "
                                 r"'ops'\]"),
    "zero loss chunk": (lambda p: ["training.loss_chunk_tokens=0"],
                        r"training.loss_chunk_tokens=0 must be >= 1, or null"),
    "a group given a value": (lambda p: ["metrics.tensorboard=true"],
                              r"metrics.tensorboard is a group of keys \(enabled\), not a value: "
                              r"did you mean metrics.tensorboard.enabled=true\?"),
    "a layout of ranks without torchrun": (lambda p: ["+recipe=llama_tp2_pp4"],
                                           r"this layout \(pp=4 x tp=2\) needs 8 ranks at least "
                                           r"and `python train.py` is one process: launch it with "
                                           r"torchrun --nproc_per_node=8 train.py"),
    "misspelt key": (lambda p: ["training.stepz=5"],
                     r"training.stepz is not a config key; did you mean training.steps"),
    "misspelt key added": (lambda p: ["+training.stepz=5"],
                           r"training.stepz is not a config key; did you mean training.steps"),
    "unknown recipe": (lambda p: ["+recipe=llama_nope"],
                       r"recipe=llama_nope is not a known recipe; choose one of"),
    "unknown model": (lambda p: ["model=llama_nope"],
                      r"model=llama_nope is not a known model; choose one of"),
    "misspelt recipe": (lambda p: ["+recipe=llama_fsd"],
                        r"recipe=llama_fsd is not a known recipe; did you mean "
                        r"\+recipe=llama_fsdp\?$"),
    "misspelt model": (lambda p: ["model=llama3_8"],
                       r"model=llama3_8 is not a known model; did you mean model=llama3_8b\?$"),
    "unknown schedule": (lambda p: ["parallel.pp_schedule=nope"],
                         r"parallel.pp_schedule=nope is unknown; choose one of"),
    "misspelt cp method, without cp": (lambda p: ["parallel.cp_method=ulyses"],
                                       r"parallel.cp_method=ulyses is unknown; choose one of "
                                       r"\['ring', 'allgather', 'ulysses'\]"),
    "tp not dividing heads": (lambda p: ["parallel.tp=3"],
                              r"parallel.tp=3 must divide model.n_heads=16"),
    "sequence too long": (lambda p: ["training.seq_len=100000"],
                          r"training.seq_len=100000 must not exceed model.max_seq_len"),
    "missing data": (lambda p: ["data.source=text", f"data.path={p}/none/*.txt"],
                     r"data.path=.*none/\*.txt matches no readable file"),
    "tokenizer not json": (lambda p: ["data.source=text", f"data.path={_text_file(p)}",
                                      f"data.tokenizer={_bad_tokenizer(p)}"],
                           r"data.tokenizer=.*is not a tokenizer"),
    "parquet that is not": (lambda p: ["data.source=parquet",
                                       f"data.path={_text_file(p, 'a.parquet')}"],
                            r"a.parquet is not a parquet file"),
    # Chat data.
    "chat rows without messages": (lambda p: _chat(p, {"text": "hi"}),
                                   r"data.messages_field=messages: .*chat.jsonl row 1 has no list "
                                   r"of \{role, content\} messages under it"),
    "a role the template rejects": (lambda p: _chat(p,
                                                    template="{% if messages[0]['role'] == 'user' "
                                                             "%}"
                                                    "{{ raise_exception('no user turns here') }}{% "
                                                    "endif %}"),
                                    r"data.chat_template: .*chat.jsonl row 1: TemplateError: no "
                                    r"user turns here"),
    "no chat template": (lambda p: _chat(p, template=None),
                         r"data.format=chat needs a chat template and the bytes tokenizer has "
                         r"none: give one with data.chat_template="),
    "a template that does not render": (lambda p: _chat(p, template="{% for m in messages %}"),
                                        r"data.chat_template: .*chat.jsonl row 1: "
                                        r"TemplateSyntaxError: "),
    "a template without the assistant's "
    "turns": (lambda p: _chat(p, template="{% for m in messages %}{% if m['role'] "
                            "!= 'assistant' %}{{ m['content'] }}{% endif %}"
                            "{% endfor %}"),
              r"data.chat_template: .*row 1: the template yields no text for "
              r"assistant turn 1"),
    "a role in another case": (lambda p: _chat(p, {"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "Assistant",
                                                                "content": "hello"}]}),
                               r"chat.jsonl row 1: message 1 has role 'Assistant': roles are "
                               r"matched as written, and chat templates name them in lower case "
                               r"\('assistant'\)"),
    "a message without content": (lambda p: _chat(p,
                                                  {"messages": [
                                                      {"role": "user", "content": None},
                                                      {"role": "assistant", "content": "hello"}]}),
                                  r"chat.jsonl row 1: message 0 \(user\) has no content \(null or "
                                  r"missing\)"),
    "an empty chat file": (lambda p: _chat(p, empty=True),
                           r"data.path=.*chat.jsonl: no conversation: the files hold "
                           r"no rows"),
    "every conversation too long": (lambda p: [*_chat(p,
                                                      {"messages": [
                                                          {"role": "user", "content": "hi"},
                                                          {"role": "assistant",
                                                           "content": "x" * 64}]},
                                                      template=EVERY_TURN), "data.overlong=drop"],
                                    r"every conversation with an assistant turn \(1\) is longer "
                                    r"than training.seq_len=32 \+ 1 tokens and data.overlong=drop "
                                    r"dropped it"),
    "no assistant turn": (lambda p: _chat(p, {"messages": [{"role": "user", "content": "hi"}]},
                                          template=EVERY_TURN),
                          r"none of its 1 conversations has a token to learn: no message has the "
                          r"role 'assistant'"),
    "prompts that are not masked": (lambda p: [*_chat(p, {"prompt": "", "completion": "4"}),
                                               "data.format=completion"],
                                    r"data.path=.*chat.jsonl: every token is a target: the prompts "
                                    r"are not masked out"),
    "chat from a token file": (lambda p: ["data.source=binary", f"data.path={p}/tokens.bin",
                                          "data.format=chat"],
                               r"data.format=chat reads rows \(data.source=json, parquet or hub\), "
                               r"not a token file"),
    "missing resume path": (lambda p: [f"checkpoint.resume={p}/none"],
                            r"checkpoint.resume=.*none is not a directory"),
    "unknown float8 recipe": (lambda p: ["training.float8.enabled=true",
                                         "training.float8.recipe=fast"],
                              r"training.float8.recipe=fast must be one of \['tensorwise', "
                              r"'rowwise', "),
    "float8 layer it cannot take": (lambda p: ["training.float8.enabled=true",
                                               "training.float8.skip_unaligned=false",
                                               "model.ffn_dim=200"],
                                    r"training.float8: layers.\*.feed_forward.w1, "
                                    r"layers.\*.feed_forward.w3, layers.\*.feed_forward.w2 have "
                                    r"dimensions float8 matmuls cannot take"),
    "fault tolerance without groups": (lambda p: ["fault_tolerance.enabled=true"],
                                       r"fault_tolerance.enabled=true needs parallel.dp_replicate "
                                       r">= 2 replica groups"),
    "more min_replicas than groups": (lambda p: ["fault_tolerance.enabled=true",
                                                 "parallel.dp_replicate=2",
                                                 "fault_tolerance.min_replicas=3"],
                                      r"fault_tolerance.min_replicas=3 must be between 1 and the "
                                      r"parallel.dp_replicate=2 groups"),
    "a replica group that is not one": (lambda p: ["fault_tolerance.enabled=true",
                                                   "parallel.dp_replicate=2",
                                                   "fault_tolerance.replica_group=2"],
                                        r"fault_tolerance.replica_group=2 must be one of the "
                                        r"parallel.dp_replicate=2"),
    "rollback with fault tolerance": (lambda p: ["fault_tolerance.enabled=true",
                                                 "parallel.dp_replicate=2",
                                                 "training.spike.threshold=3",
                                                 "training.spike.action=rollback",
                                                 "checkpoint.enabled=true"],
                                      r"training.spike.action=rollback cannot be combined with "
                                      r"fault_tolerance"),
    "lighthouse not reachable": (lambda p: ["fault_tolerance.enabled=true",
                                            "parallel.dp_replicate=2",
                                            "fault_tolerance.lighthouse=http://127.0.0.1:9",
                                            "distributed.timeout_s=1"],
                                 r"fault_tolerance.lighthouse=http://127.0.0.1:9 cannot be reached "
                                 r"\(.*\) within distributed.timeout_s=1"),
    # Qwen3 and the DeepSeek-V3 routing options.
    "odd head dimension": (lambda p: ["model=qwen3_debug", "model.head_dim=33"],
                           r"model.head_dim=33 \(a head's width: 33\) must be even: the rotary "
                           r"embedding"),
    "shared experts with no MoE": (lambda p: ["model.n_shared_experts=1"],
                                   r"model.n_shared_experts is not a key of model.family=llama; it "
                                   r"is one of model.family=deepseek_v3 or mixtral or qwen3_moe"),
    "groups not dividing the experts": (lambda p: ["model=qwen3_moe_debug",
                                                   "model.n_expert_groups=3"],
                                        r"model.n_expert_groups=3 must divide model.n_experts=16"),
    "more top groups than groups": (lambda p: ["model=qwen3_moe_debug", "model.n_expert_groups=4",
                                               "model.top_groups=5"],
                                    r"model.top_groups=5 must be between 1 and "
                                    r"model.n_expert_groups=4"),
    "unknown route score": (lambda p: ["model=qwen3_moe_debug", "model.route_score=tanh"],
                            r"model.route_score=tanh is unknown; choose one of \['softmax', "
                            r"'sigmoid'\]"),
    "aux-free bias with fault tolerance": (lambda p: ["model=qwen3_moe_debug",
                                                      "model.bias_update_speed=0.001",
                                                      "fault_tolerance.enabled=true",
                                                      "parallel.dp_replicate=2"],
                                           r"model.bias_update_speed=0.001 cannot be combined with "
                                           r"fault_tolerance"),
    # DeepSeek-V3's latent attention and dense blocks.
    "odd rotary width": (lambda p: ["model=deepseek_v3_debug", "model.qk_rope_head_dim=7"],
                         r"model.qk_rope_head_dim=7 must be even: the rotary embedding turns "
                         r"pairs"),
    "a query latent of rank 0": (lambda p: ["model=deepseek_v3_debug", "model.q_lora_rank=0"],
                                 r"model.q_lora_rank=0 must be between 1 and model.dim=128, or "
                                 r"null"),
    "a key/value latent wider than the model": (lambda p: ["model=deepseek_v3_debug",
                                                           "model.kv_lora_rank=256"],
                                                r"model.kv_lora_rank=256 must be between 1 and "
                                                r"model.dim=128"),
    "more dense blocks than blocks": (lambda p: ["model=deepseek_v3_debug",
                                                 "model.n_dense_layers=9"],
                                      r"model.n_dense_layers=9 must be between 0 and "
                                      r"model.n_layers - 1=7"),
    "a misspelt key of the family's": (lambda p: ["model=deepseek_v3_debug",
                                                  "model.kv_lora_rnak=16"],
                                       r"model.kv_lora_rnak is not a key of "
                                       r"model.family=deepseek_v3; did you mean "
                                       r"model.kv_lora_rank\?"),
    "a word for an integer": (lambda p: ["training.steps=abc"],
                              r"^config error: training.steps=abc must be an integer$"),
    "a word for a number": (lambda p: ["training.lr=fast"],
                            r"^config error: training.lr=fast must be a number$"),
    "a word for a bool": (lambda p: ["training.compile=maybe"],
                          r"^config error: training.compile=maybe must be true or false$"),
    # LoRA
    "a peft key without peft.method": (lambda p: ["peft.rank=4"],
                                       r"peft.rank=4 is set but peft.method is not"),
    "an unknown peft method": (lambda p: ["peft.method=dora"],
                               r"peft.method=dora is unknown; choose one of \['lora'\]"),
    "a LoRA rank of 0": (lambda p: ["peft.method=lora", "peft.rank=0"],
                         r"peft.rank=0 must be at least 1"),
    "a LoRA rank above a layer's width": (lambda p: ["peft.method=lora", "peft.rank=999"],
                                          r"peft.rank=999 is above the width of "
                                          r"layers.0.attention.wq \(256 -> 256\)"),
    "a target pattern matching no layer": (lambda p: ["peft.method=lora",
                                                      "peft.target_modules=[q_proj]"],
                                           r"peft.target_modules: q_proj matches no linear layer"),
    "LoRA with Muon": (lambda p: ["peft.method=lora", "optim=muon"],
                       r"peft.method=lora trains its adapters with optim.name=adamw"),
    "an unknown base dtype": (lambda p: ["peft.method=lora", "peft.base_dtype=int4"],
                              r"peft.base_dtype=int4 is unknown; choose nf4 \(QLoRA\) or null"),
    "a QLoRA layer not of 4-bit blocks": (lambda p: ["peft.method=lora", "peft.base_dtype=nf4",
                                                     "model.dim=36", "model.n_heads=2",
                                                     "model.n_kv_heads=2"],
                                          r"peft.base_dtype=nf4 cannot hold "
                                          r"layers.0.attention.wq in 4 bits over dp_shard\*cp=1 "
                                          r"ranks: its 1296 weights are not a multiple of 64"),
    "LoRA adapters as initial of another rank": (
        lambda p: [f"checkpoint.initial={lora_checkpoint(p)}", "peft.method=lora", "peft.rank=4"],
        r"lora holds rank-8, alpha-16 adapters on 1 layers \(wq\); this model's are rank 4, alpha "
        r"16 on 56 \(w1, w2, w3, wk, wo, wq, wv\)"),
    "LoRA adapters as initial of a full fine-tune": (
        lambda p: [f"checkpoint.initial={lora_checkpoint(p)}"],
        r"checkpoint.initial=.*lora holds LoRA adapters: train on from them with peft.method=lora"),
    "LoRA adapters resumed as a full fine-tune": (
        lambda p: [f"checkpoint.resume={lora_checkpoint(p)}"],
        r"checkpoint.resume=.*lora holds LoRA adapters on a frozen base"),
    # Ulysses context parallel
    "a Ulysses degree that does not divide the heads": (
        lambda p: ["parallel.cp=3", "parallel.cp_method=ulysses", "training.seq_len=48"],
        r"parallel.cp=3 must divide the attention heads it splits, model.n_heads=16; nearest that "
        r"work: parallel.cp=2 or parallel.cp=4"),
    "a hybrid split that does not divide cp": (
        lambda p: ["parallel.cp=2", "parallel.cp_ulysses=4"],
        r"parallel.cp_ulysses=4 must divide parallel.cp=2"),
    "initial not a model": (lambda p: [f"checkpoint.initial={p}"],
                            r"checkpoint.initial=.* is neither a Hugging Face model"),
}


def lora_checkpoint(folder: Path) -> Path:
    """A LoRA checkpoint's files as the checks before launch read them: its manifest, its peft keys
    and the names of its adapters (rank 8 on layer 0's wq)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf

    path = folder / "lora"
    adapters = {"model.layers.0.attention.wq.lora_A": torch.zeros(8, 256),
                "model.layers.0.attention.wq.lora_B": torch.zeros(256, 8)}
    dcp.save(adapters, checkpoint_id=path, no_dist=True)
    OmegaConf.save(OmegaConf.create({"method": "lora", "rank": 8, "alpha": 16.0, "base": None}),
                   path / "adapter.yaml")
    (path / "manifest.json").write_text(json.dumps({"step": 1, "files": {}}))
    return path


EXTRA = {"float8 layer it cannot take": NEEDS_TORCHAO,
         "a QLoRA layer not of 4-bit blocks": NEEDS_TORCHAO,
         "lighthouse not reachable": NEEDS_TORCHFT}
HIDDEN = {"tensorboard without its package": "tensorboard"}  # imports as if not installed


@pytest.mark.parametrize("name",
                         [pytest.param(name, marks=EXTRA.get(name, ())) for name in MISTAKES])
def test_each_mistake_is_one_config_error_line_and_exit_2(name, tmp_path, capfd, monkeypatch):
    overrides, says = MISTAKES[name]
    monkeypatch.setenv("TRAINER_CACHE", str(tmp_path / "cache"))
    if name in HIDDEN:
        monkeypatch.setitem(sys.modules, HIDDEN[name], None)
    # plan.check=false: the memory plan runs in a process of its own, and has nothing to say here.
    argv = ["model=llama_debug", "+smoke=cpu", "training.steps=2", "training.seq_len=32",
            "plan.check=false", f"output_dir={tmp_path / 'out'}", *overrides(tmp_path)]
    assert run_train(argv) == 2
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err
    assert err.startswith("config error: ") and err.count("\n") == 1, err
    assert re.search(says, err), err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_recipe_that_does_not_parse_fails_only_the_commands_that_choose_it(tmp_path, monkeypatch):
    """A user's recipe with a syntax error beside the team's: choosing it is one line naming the
    file and where it stops parsing; every other recipe composes as before."""
    from trainer.checks import overrides
    from trainer.config import files as config_files

    shutil.copy(config_files.RECIPE_DIR / "llama_fsdp.yaml", tmp_path)
    (tmp_path / "mine.yaml").write_text("training:\n  steps: 5\n  seq_len: [1, 2\nbad: {\n")
    for module in (config_files, overrides):
        monkeypatch.setattr(module, "RECIPE_DIR", tmp_path)
    monkeypatch.setitem(config_files.BROKEN_RECIPES, "mine", None)  # (removed again afterwards)
    assert overrides.compose_job(["+recipe=llama_fsdp"]).parallel.dp_shard == -1
    with pytest.raises(ConfigError,
                       match=r"mine.yaml does not parse \(line 4, column 4\): expected ',' or ']'"):
        overrides.compose_job(["+recipe=mine"])


def token_file(path, ids, **description):
    """A token file of `ids` (uint16) and its .json, the description's keys overridable (None
    drops one)."""
    np.asarray(ids, dtype=np.uint16).tofile(path)
    meta = {"dtype": "uint16", "tokens": len(ids), "vocab_size": 256, "eos_id": 0,
            **description}
    Path(f"{path}.json").write_text(json.dumps({k: v for k, v in meta.items() if v is not None}))


def test_a_token_id_the_vocabulary_does_not_hold_is_named_where_it_is_read(tmp_path):
    """Before launch for the file's first ids; as its window is read for the rest (on a GPU the
    embedding would end in a device-side assert naming nothing)."""
    data = DataConfig(source="binary", path=str(tmp_path / "early.bin"))
    token_file(tmp_path / "early.bin", [1] * 40 + [5000] + [1] * 600)
    with pytest.raises(ConfigError, match=r"early.bin holds token id 5000 at token 40, outside "
                                          r"its vocabulary of 256"):
        build_dataset(data, 64, 0, "all")
    late = SCANNED_TOKENS + 100  # past what is checked before launch
    token_file(tmp_path / "late.bin", [1] * late + [300] + [1] * 100)
    windows = build_dataset(dataclasses.replace(data, path=str(tmp_path / "late.bin")), 64, 0,
                            "all")
    with pytest.raises(ConfigError, match=f"holds token id 300 at token {late}"):
        windows[late // 64]


@pytest.mark.parametrize("description, message", [
    ({"dtype": None}, r"dtype is None \(missing, or not one of \['uint16', 'uint32'\]\)"),
    ({"dtype": "float32"}, r"dtype is 'float32'"),
    ({"tokens": "many"}, r"tokens is 'many' \(missing, or not an integer >= 0\)"),
    ({"vocab_size": None}, r"vocab_size is None"),
    ({"eos_id": 999}, r"eos_id is 999, not a token id below its vocab_size 256"),
    ("{not json", r"is not readable JSON"),
])
def test_a_token_files_description_missing_or_wrong_is_one_line(tmp_path, description, message):
    if isinstance(description, str):
        token_file(tmp_path / "t.bin", [1] * 100)
        Path(f"{tmp_path / 't.bin'}.json").write_text(description)
    else:
        token_file(tmp_path / "t.bin", [1] * 100, **description)
    with pytest.raises(ConfigError, match=message):
        build_dataset(DataConfig(source="binary", path=str(tmp_path / "t.bin")), 16, 0, "all")


def test_a_damaged_parquet_page_is_passed_over_and_said_or_refused_when_strict(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"row {i} " * 20 for i in range(200)]}),
                   tmp_path / "a.parquet", compression="snappy")
    raw = bytearray((tmp_path / "a.parquet").read_bytes())
    raw[100:400] = bytes(b ^ 0x5A for b in raw[100:400])  # inside the first data page
    (tmp_path / "a.parquet").write_bytes(bytes(raw))
    problems = Problems(strict=False)
    assert list(documents("parquet", str(tmp_path / "a.parquet"), problems=problems)) == []
    assert problems.lines()[0].startswith("data: passed over 1 files with a damaged page")
    with pytest.raises(ConfigError, match=r"data.strict=true: .*a.parquet after row 0 "
                                          r"\(.*\): a damaged page"):
        list(documents("parquet", str(tmp_path / "a.parquet"), problems=Problems(strict=True)))
