"""Conversations for fine-tuning: rows of `messages` (data.format=chat) rendered through the model's
own chat template, or `prompt`/`completion` pairs (data.format=completion) joined as plain text;
tokenized, with the tokens the loss covers marked, and packed into windows.

An assistant turn is found without reading any template's markup: turn i is what rendering the
conversation up to and including it adds to rendering the turns before it with the generation prompt
(the text a model is prompted with at inference), its trailing whitespace left out. So the loss
covers each assistant turn's content and the end-of-turn text the template writes after it, in every
turn of a conversation, and nothing else; a template with generation markers and one without give
the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainer.data.readers import Problems, file_rows, text_paths
from trainer.data.tokenizer import is_bytes
from trainer.errors import ConfigError

FORMATS = ("text", "chat", "completion")
OVERLONG = ("truncate", "drop")


def render(template: str, messages: list[dict], special: dict, generation_prompt: bool) -> str:
    """The template's text for `messages`, rendered as transformers renders chat templates (its
    sandboxed Jinja environment, filters and globals): what a model is prompted with at
    inference."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                        add_generation_prompt=generation_prompt, **special)
    return rendered[0]


def chat_template(tokenizer: str, template_file: str | None) -> tuple[str, dict]:
    """The template (data.chat_template's file, else the chat_template of the tokenizer's
    tokenizer_config.json) and the special tokens templates name (bos_token, eos_token, ...)."""
    folder = Path(tokenizer) if Path(tokenizer).is_dir() else Path(tokenizer).parent
    config_file = None if is_bytes(tokenizer) else folder / "tokenizer_config.json"
    config = (json.loads(config_file.read_text()) if config_file is not None
              and config_file.is_file() else {})
    special = {key: value.get("content") if isinstance(value, dict) else value
               for key, value in config.items()
               if key.endswith("_token") and isinstance(value, (str, dict))}
    if template_file is not None:
        if not Path(template_file).is_file():
            raise ConfigError(f"data.chat_template={template_file} is not a file")
        return Path(template_file).read_text(), special
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not template:
        whose = "the bytes tokenizer has" if config_file is None else f"{config_file} has"
        raise ConfigError(f"data.format=chat needs a chat template and {whose} none: give one with "
                          f"data.chat_template=<a Jinja file>")
    return template, special


@dataclass
class Conversations:
    """Tokenized conversations, one after another, and what their reading counted."""

    ids: np.ndarray  # every conversation's tokens
    supervised: np.ndarray  # bool: whether each token is a target of the loss
    offsets: np.ndarray  # [conversations + 1]: where each starts in ids
    unsupervised: int = 0  # conversations with no token to learn, skipped
    truncated: int = 0
    dropped: int = 0
    example: str = ""  # the first conversation, its unsupervised text in [[ ]]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def conversation(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        span = slice(self.offsets[i], self.offsets[i + 1])
        return self.ids[span], self.supervised[span]

    def share(self) -> float:
        return float(self.supervised.mean()) if len(self.supervised) else 0.0


@dataclass
class _Reading:
    """Conversations as they are read: kept, or counted and passed over."""

    ids: list = field(default_factory=list)
    supervised: list = field(default_factory=list)
    counts: dict = field(default_factory=lambda: {"unsupervised": 0, "truncated": 0, "dropped": 0})
    example: str = ""

    def add(self, ids: list[int], supervised: list[bool], seq_len: int, overlong: str,
            show) -> None:
        if not any(supervised):
            self.counts["unsupervised"] += 1
            return
        if len(ids) > seq_len + 1:
            if overlong == "drop":
                self.counts["dropped"] += 1
                return
            ids, supervised = ids[:seq_len + 1], supervised[:seq_len + 1]
            self.counts["truncated"] += 1
        if not self.ids:
            self.example = show(ids, supervised)
        self.ids.append(np.asarray(ids, dtype=np.int64))
        self.supervised.append(np.asarray(supervised, dtype=bool))

    def done(self) -> Conversations:
        offsets = np.concatenate([[0], np.cumsum([len(ids) for ids in self.ids])]).astype(np.int64)
        return Conversations(np.concatenate(self.ids), np.concatenate(self.supervised), offsets,
                             **self.counts, example=self.example)


def marked_tokens(text: str, spans: list[tuple[int, int]],
                  tokenizer) -> tuple[list[int], list[bool]]:
    """The tokens of `text` and whether each starts inside one of the character spans."""
    if hasattr(tokenizer, "tokenizer"):  # a Hugging Face tokenizer: character offsets
        encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
        ids, starts = encoding.ids, [start for start, _ in encoding.offsets]
    else:  # bytes: one token a byte
        ids, starts, at = tokenizer.encode(text), [], 0
        for char in text:
            starts += [at] * len(char.encode("utf-8"))
            at += 1
    return ids, [any(a <= s < b for a, b in spans) for s in starts]


def assistant_spans(messages: list[dict], template: str, special: dict,
                    where: str) -> tuple[str, list]:
    """The conversation's text and the character spans of its assistant turns."""
    try:
        text = render(template, messages, special, generation_prompt=False)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = render(template, messages[:i], special, generation_prompt=True)
            turn = render(template, messages[:i + 1], special, generation_prompt=False)
            if not turn.startswith(before) or not text.startswith(before):
                raise ConfigError(f"data.chat_template: {where}: rendering turn {i} does not "
                                  "extend the text before it with the generation prompt, so the "
                                  "assistant's text cannot be found")
            span = _turn_span(text, before, turn, message.get("content"))
            if span is None:
                raise ConfigError(f"data.chat_template: {where}: the template yields no text for "
                                  f"assistant turn {i}, or renders it in the whole conversation "
                                  "otherwise than last")
            spans.append(span)
    except ConfigError:
        raise
    # Jinja's errors (a role the template rejects, a template that does not render)
    except Exception as e:
        raise ConfigError(f"data.chat_template: {where}: {type(e).__name__}: {e}") from None
    return text, spans


def _turn_span(text: str, before: str, turn: str, content) -> tuple[int, int] | None:
    """Where an assistant turn lies in the whole conversation's `text`: from the end of `before`
    (the text up to it, with the generation prompt) through what rendering it last (`turn`) adds,
    trailing whitespace left out. A template may render a past turn otherwise (Qwen3's drops its
    reasoning block): then through its content and the end-of-turn text written after the
    content."""
    begin, said = len(before), turn[len(before):].rstrip()
    if said and text.startswith(said, begin):
        return begin, begin + len(said)
    if not isinstance(content, str) or not content or content not in turn:
        return None
    at = text.find(content, begin)
    after = turn[turn.rfind(content) + len(content):].rstrip()
    if at < 0 or not text.startswith(after, at + len(content)):
        return None
    return begin, at + len(content) + len(after)


def conversation_rows(data, problems: Problems):
    """(row, where) for each row of data.path's json/jsonl or parquet files, or of the Hub dataset
    data.path (data.subset, data.split), streamed through once."""
    if data.source == "hub":
        from trainer.data.hub import hub_rows

        yield from ((row, f"{data.path} row {number}")
                    for number, row in enumerate(hub_rows(data), 1))
        return
    for path in text_paths(data.path, data.source):
        for number, row in enumerate(file_rows(data.source, path, problems), 1):
            yield row, f"{path} row {number}"


def read_conversations(data, tokenizer, seq_len: int) -> Conversations:
    """Every row of data.path as tokens with the loss's marks (see the module's docstring)."""
    problems = Problems(strict=data.strict)
    if data.format == "chat":
        template, special = chat_template(data.tokenizer, data.chat_template)
    reading = _Reading()

    def show(ids, supervised):
        pieces, run = [], []
        for i, (token, learned) in enumerate(zip(ids, supervised)):
            run.append(token)
            if i + 1 == len(ids) or supervised[i + 1] != learned:
                hf = getattr(tokenizer, "tokenizer", None)  # (special tokens shown)
                decoded = (hf.decode(run, skip_special_tokens=False) if hf is not None
                           else tokenizer.decode(run))
                pieces.append(decoded if learned else f"[[{decoded}]]")
                run = []
        return "".join(pieces)

    rows = 0
    for row, where in conversation_rows(data, problems):
        rows += 1
        if data.format == "chat":
            messages = row.get(data.messages_field)
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m
                                                         for m in messages):
                raise ConfigError(f"data.messages_field={data.messages_field}: {where} has no list "
                                  "of {role, content} messages under it")
            check_messages(messages, where)
            text, spans = assistant_spans(messages, template, special, where)
            ids, supervised = marked_tokens(text, spans, tokenizer)
        else:
            prompt, completion = row.get(data.prompt_field), row.get(data.completion_field)
            if not isinstance(prompt, str) or not isinstance(completion, str):
                raise ConfigError(f"data.prompt_field={data.prompt_field}, data.completion_field="
                                  f"{data.completion_field}: {where} lacks one of them")
            bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
            head, tail = (bos + tokenizer.encode(prompt),
                          tokenizer.encode(completion) + [tokenizer.eos_id])
            ids, supervised = head + tail, [False] * len(head) + [True] * len(tail)
        reading.add(ids, supervised, seq_len, data.overlong, show)
    if not reading.ids:
        raise ConfigError(f"data.path={data.path}: "
                          f"{nothing_to_learn(rows, reading.counts, seq_len)}")
    if all(s.all() for s in reading.supervised):
        raise ConfigError(f"data.path={data.path}: every token is a target: the prompts are not "
                          "masked out")
    return reading.done()


ROLES = ("system", "user", "assistant", "tool")  # as chat templates name them


def check_messages(messages: list[dict], where: str) -> None:
    """A role in another case than templates match (`Assistant`: its turn would not be learned), and
    a message without text (content null would render as the word None), refused with the row
    named."""
    for i, message in enumerate(messages):
        role, content = message["role"], message.get("content")
        if isinstance(role, str) and role != role.lower() and role.lower() in ROLES:
            raise ConfigError(f"{where}: message {i} has role {role!r}: roles are matched as "
                              "written, and chat templates name them in lower case "
                              f"({role.lower()!r})")
        if content is None and not message.get("tool_calls"):
            raise ConfigError(f"{where}: message {i} ({role}) has no content (null or missing): "
                              "give it a text (\"\" for none)")


def nothing_to_learn(rows: int, counts: dict, seq_len: int) -> str:
    """Why no conversation was kept: no rows, every one too long, or none with an assistant turn."""
    if rows == 0:
        return "no conversation: the files hold no rows"
    if counts["dropped"]:
        return (f"every conversation with an assistant turn ({counts['dropped']}) is longer than "
                f"training.seq_len={seq_len} + 1 tokens and data.overlong=drop dropped it: raise "
                "training.seq_len, or set data.overlong=truncate")
    return (f"none of its {rows} conversations has a token to learn: no message has the role "
            "'assistant' (or the template renders none)")


def describe(conversations: Conversations, data) -> str:
    """The start-up lines: what was read, what the loss covers, and an example."""
    counted = [f"{n} {what}" for n, what in ((conversations.truncated, "truncated"),
                                             (conversations.dropped,
"dropped (data.overlong=drop)"), (conversations.unsupervised, "skipped, no assistant token"))
               if n]
    return (f"data: {len(conversations)} conversations (data.format={data.format}), "
            f"{100 * conversations.share():.1f}% of their tokens supervised"
            f"{'; ' + ', '.join(counted) if counted else ''}\n"
            f"data: the first conversation, [[not learned]]: {conversations.example!r}")

