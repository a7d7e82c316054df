"""Chat and completion data: the loss covers exactly the assistant's turns (found without reading
the template's markup), conversations are packed whole with positions restarting at each, and the
labels not learned are left out of the loss."""

import json
import random
import sys
import warnings

import numpy as np
import pytest
import torch
from helpers import REPO, run_script, train_metrics
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers.utils.chat_template_utils import render_jinja_template

from trainer.config.schema import DataConfig
from trainer.data.chat import assistant_spans, read_conversations
from trainer.data.chat_windows import ChatWindows
from trainer.data.loader import conversation_batch
from trainer.data.tokenizer import ByteTokenizer, HFTokenizer
from trainer.models.head import IGNORE_INDEX

sys.path.insert(0, str(REPO / "scripts"))
# noqa: E402  (1 to 3 turns, answers reversed)
from chat_example import conversations as digits_conversations

# A template with generation markers around what the assistant says, and the same without them.
MARKED = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' "
          "%}{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}{% else %}{{ m['content'] "
          "}}<|end|>{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif "
          "%}")
PLAIN = MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
SPECIAL = ["<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CONVERSATION = [{"role": "system", "content": "answer briefly"},
                {"role": "user", "content": "two and two?"},
                {"role": "assistant", "content": "four"},
                {"role": "user", "content": "and three more?"},
                {"role": "assistant", "content": "seven, with \u00e9clat"}]


def write_chat(folder, rows: list[dict], template: str = PLAIN) -> tuple[str, str]:
    """A jsonl of `rows` and a template file: (data.path, data.chat_template)."""
    folder.mkdir(exist_ok=True)
    (folder / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "template.jinja").write_text(template)
    return str(folder / "chat.jsonl"), str(folder / "template.jinja")


def bpe_with_template(folder) -> str:
    """A byte-level BPE whose chat markers are special tokens, its template in
    tokenizer_config.json."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", *SPECIAL],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([m["content"] for m in CONVERSATION] * 20, trainer)
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "bos_token": "<s>", "chat_template": PLAIN}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def spans_by_markers(messages: list[dict]) -> list[tuple[int, int]]:
    """transformers' own assistant spans: the character ranges its generation markers enclose."""
    _, indices = render_jinja_template(conversations=[messages], chat_template=MARKED,
                                       return_assistant_tokens_mask=True, bos_token="<s>")
    return [tuple(span) for span in indices[0]]


@pytest.mark.parametrize("template", [MARKED, PLAIN], ids=["markers", "no markers"])
def test_the_loss_covers_each_assistant_turn_and_its_end_of_turn_only(template, tmp_path):
    _, spans = assistant_spans(CONVERSATION, template, {"bos_token": "<s>"}, "test")
    assert spans == spans_by_markers(CONVERSATION) and len(spans) == 2
    path, template_file = write_chat(tmp_path, [{"messages": CONVERSATION}], template)
    for spec in ("bytes", bpe_with_template(tmp_path / "tok")):
        # The bytes with the template file; the BPE with the template of its tokenizer_config.json.
        data = DataConfig(source="json", format="chat", path=path, tokenizer=spec,
                          chat_template=template_file if spec == "bytes" else None)
        tokenizer = ByteTokenizer() if spec == "bytes" else HFTokenizer(spec)
        conversation = read_conversations(data, tokenizer, seq_len=512)
        ids, supervised = conversation.conversation(0)
        kept = [i for i, s in zip(ids, supervised) if s]
        learned = (tokenizer.decode(kept) if spec == "bytes"
                   else tokenizer.tokenizer.decode(kept, False))
        assert learned == "four<|end|>seven, with \u00e9clat<|end|>", learned
        # (the bytes have no special tokens for a template to name)
        bos = "" if spec == "bytes" else "<s>"
        assert conversation.example.startswith(f"[[{bos}<|system|>answer "
                                               "briefly<|end|><|user|>"), conversation.example


def test_completion_rows_learn_the_completion_and_the_end_of_sequence(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    data = DataConfig(source="json", format="completion", path=str(path), tokenizer="bytes")
    conversation = read_conversations(data, ByteTokenizer(), seq_len=64)
    ids, supervised = conversation.conversation(0)
    assert ids.tolist() == [*b"2+2=4", 0] and supervised.tolist() == [False] * 4 + [True, True]


def test_packed_windows_restart_positions_and_leave_prompts_out_of_the_labels(tmp_path):
    path, template = write_chat(tmp_path, digits_conversations(40))
    data = DataConfig(source="json", format="chat", path=path, chat_template=template,
                      tokenizer="bytes")
    conversations = read_conversations(data, ByteTokenizer(), seq_len=256)
    for array in (conversations.ids, conversations.supervised, conversations.offsets):
        array.setflags(write=False)  # as the cache maps them: read without a warning
    windows = ChatWindows(conversations, 256, pack=True, split="train", pad_id=0, vocab_size=256,
                          eos_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inputs, labels, positions = conversation_batch(torch.stack(list(windows)))
    # Whole conversations, several a window: positions restart at each one's first token.
    starts = (positions == 0).sum().item()
    assert starts == len(conversations) - 1 and len(windows) < 0.6 * starts
    # the tokens of the conversations before the held-out last one
    train = conversations.offsets[-2]
    learned = torch.from_numpy(conversations.ids[:train][conversations.supervised[:train]])
    # every assistant token once, in order
    assert torch.equal(labels[labels != IGNORE_INDEX], learned)
    one_each = ChatWindows(conversations, 256, pack=False, split="val", pad_id=0, vocab_size=256,
                           eos_id=0)
    assert len(one_each) == 1  # the last conversation, held out


# Question and answer, no markers a model could lean on: "Q:<digits>\nA:<the digits reversed>;\n".
QA = ("{% for m in messages %}{% if m['role'] == 'user' %}Q:{{ m['content'] }}\n{% else %}A:{{ "
      "m['content'] }};\n{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}")


@pytest.mark.multiprocess
def test_answers_that_are_a_function_of_random_prompts_are_learned_to_near_zero_loss(tmp_path):
    """The prompts are random digits (about 2.3 nats a digit, over a third of the tokens): were they
    targets, the loss could not fall below about 0.8. The answers, the digits reversed, can be
    learned."""
    r = random.Random(0)
    rows = []
    for _ in range(3000):
        digits = "".join(r.choice("0123456789") for _ in range(r.randint(1, 6)))
        rows.append({"messages": [{"role": "user", "content": digits},
                                  {"role": "assistant", "content": digits[::-1]}]})
    path, template = write_chat(tmp_path, rows, QA)
    records = train_metrics(1, "model=llama_debug", "model.n_layers=2", "+smoke=cpu",
                            "data.source=json", f"data.path={path}", "data.format=chat",
                            f"data.chat_template={template}", "training.seq_len=64",
                            "training.global_batch_size=16", "training.steps=100",
                            "training.lr=3e-3", "training.warmup_steps=10", "validation.every=25",
                            "validation.steps=2", output_dir=tmp_path / "run")
    curve = [r["val_loss"] for r in records if "val_loss" in r]
    print("validation loss on the answers:", [round(v, 4) for v in curve])
    assert curve[0] > 0.5 and curve[-1] < 0.1, curve


@pytest.mark.multiprocess
def test_fine_tuned_from_hugging_face_and_back_transformers_prompts_it_as_it_was_trained(tmp_path):
    """A random transformers Llama with a BPE tokenizer and its chat template: fine-tuned on
    conversations from its directory, exported, loaded by transformers, whose logits on a
    conversation rendered by its own tokenizer's template equal the trainer's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trainer import build_model, load_weights

    hf = bpe_with_template(tmp_path / "hf")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                 max_position_embeddings=256,
                                 tie_word_embeddings=False)).save_pretrained(hf)
    path, _ = write_chat(tmp_path, [{"messages": CONVERSATION}] * 64)
    shape = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 320,
             "ffn_dim": 96, "norm_eps": 1e-6}
    records = train_metrics(1, "model=llama_debug", *(f"model.{k}={v}" for k, v in shape.items()),
                            "+smoke=cpu", f"checkpoint.initial={hf}", "data.source=json",
                            f"data.path={path}", "data.format=chat", "training.seq_len=64",
                            "training.steps=3", "checkpoint.enabled=true",
                            output_dir=tmp_path / "run")
    assert records[-1]["loss"] < records[0]["loss"] and records[0]["supervised_tokens"] > 0
    result = run_script(REPO / "scripts" / "convert_hf.py", "to-hf",
                        tmp_path / "run" / "checkpoints" / "step_3", tmp_path / "out", "--dtype",
                        "float32")
    assert result.returncode == 0, result.stderr[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    prompt = tokenizer.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
    assert tokenizer.decode(prompt[0]).endswith("<|user|>two and two?<|end|><|assistant|>")
    ours = build_model({"family": "llama", **shape})
    load_weights(ours, tmp_path / "run" / "checkpoints" / "step_3")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(theirs(prompt).logits, ours(prompt), rtol=1e-5, atol=1e-5)


def test_conversations_are_read_once_into_the_cache_from_json_parquet_or_the_hub(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainer.data.chat_windows import cached_conversations

    rows = digits_conversations(30)
    path, template = write_chat(tmp_path, rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    data = DataConfig(source="json", format="chat", path=path, chat_template=template,
                      tokenizer="bytes", cache_dir=str(tmp_path / "cache"))
    first = cached_conversations(data, ByteTokenizer(), 128)
    again = cached_conversations(data, ByteTokenizer(), 128)
    assert capsys.readouterr().out.count("data: reading the conversations") == 1
    assert (isinstance(again.ids, np.memmap) and np.array_equal(first.ids, again.ids)
            and len(again) == 30)
    # a Hub dataset by name: here a local folder, as the Hub would serve it
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "train.jsonl").write_text((tmp_path / "chat.jsonl").read_text())
    for source, where in (("parquet", tmp_path / "chat.parquet"), ("hub", tmp_path / "hub")):
        data.source, data.path = source, str(where)
        other = cached_conversations(data, ByteTokenizer(), 128)
        assert np.array_equal(other.ids, first.ids), source
        assert np.array_equal(other.supervised, first.supervised), source


def test_a_template_that_renders_past_turns_otherwise_still_has_each_turn_found(tmp_path):
    """Like Qwen3's: the last assistant turn gets a reasoning block, earlier ones do not."""
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' and "
                "loop.last %}<think></think>{% endif %}{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    text, spans = assistant_spans(CONVERSATION, template, {}, "test")
    assert [text[a:b] for a, b in spans] == ["four<|end|>",
                                             "<think></think>seven, with \u00e9clat<|end|>"]
