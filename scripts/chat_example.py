"""Writes a small chat dataset to fine-tune on without downloading anything: OUT/chat.jsonl,
conversations of 1 to 3 turns whose answers are the user's digits reversed, and
OUT/template.jinja, a chat template for them (the byte tokenizer has none of its own).

    python scripts/chat_example.py data/chat [--conversations 2000] [--seed 0]
    bash scripts/smoke_cpu.sh llama_sft 2 data.path=data/chat/chat.jsonl \
        data.chat_template=data/chat/template.jinja
"""

import argparse
import json
import random
from pathlib import Path

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def conversations(count: int, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    rows = []
    for _ in range(count):
        messages = [{"role": "system", "content": "Answer with the digits "
                                                  "reversed."}] if r.random() < 0.3 else []
        for _ in range(r.choice([1, 1, 2, 3])):
            digits = "".join(r.choice("0123456789") for _ in range(r.randint(1, 12)))
            messages += [{"role": "user", "content": digits},
                         {"role": "assistant", "content": digits[::-1]}]
        rows.append({"messages": messages})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    there = [args.out / name for name in ("chat.jsonl", "template.jinja")
             if (args.out / name).exists()]
    if there:
        raise SystemExit(f"{there[0]} exists: give another folder (nothing of yours is "
                         "overwritten)")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = conversations(args.conversations, args.seed)
    (args.out / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (args.out / "template.jinja").write_text(TEMPLATE)
    print(f"wrote {len(rows)} conversations to {args.out / 'chat.jsonl'} and a chat template to "
          f"{args.out / 'template.jinja'}")


if __name__ == "__main__":
    main()
