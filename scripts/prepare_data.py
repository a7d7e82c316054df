"""Tokenizes a corpus once into the trainer's binary format: a flat array of token ids (uint16
when the vocabulary fits, else uint32) in OUT, described by OUT.json; train with
`data.source=binary data.path=OUT`.

    python scripts/prepare_data.py 'corpus/*.txt' data/corpus.bin [--tokenizer PATH|bytes] \
        [--workers 4]
    python scripts/prepare_data.py 'corpus/*.jsonl' data/corpus.bin --source json --text-field text

The documents (each text file, or each row of json/jsonl/parquet files) are cut into pieces that
several processes tokenize at once, in order: the same stream as `data.source=text` (or json,
parquet) with the same `data.path` reads, whatever the number of workers.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.data.cache import TokenWriter  # noqa: E402
from trainer.data.readers import Problems, documents, text_paths  # noqa: E402
from trainer.data.tokenizer import CHUNK_CHARS, build_tokenizer, encode_pieces, pieces  # noqa: E402
from trainer.errors import ConfigError  # noqa: E402
from trainer.safe_write import check_new_output  # noqa: E402

GROUP_CHARS = 4 * CHUNK_CHARS  # text handed to a worker at once


def _groups(pieces_):
    """Consecutive pieces in groups of about GROUP_CHARS characters (many small documents make
    one)."""
    group, size = [], 0
    for piece in pieces_:
        group.append(piece)
        size += len(piece[0])
        if size >= GROUP_CHARS:
            yield group
            group, size = [], 0
    if group:
        yield group


def _tokenize(group: list, spec: str) -> tuple[np.ndarray, int]:
    return encode_pieces(group, build_tokenizer(spec)), sum(len(text) for text, _, _ in group)


def prepare(pattern: str, out: Path, source: str, text_field: str, tokenizer: str,
            workers: int) -> dict:
    tok = build_tokenizer(tokenizer)
    problems = Problems(strict=False)
    groups = _groups(pieces(documents(source, pattern, text_field, problems)))
    started = time.perf_counter()
    with Pool(workers) as pool, TokenWriter(out, tok) as writer, \
            tqdm(unit="char", unit_scale=True, desc="tokenizing") as bar:

        def write(result) -> None:
            ids, chars = result.get()
            writer.write(ids)
            bar.update(chars)

        # Groups are written in order (the stream is the same with any number of workers), and only
        # a few per worker are in flight, so a corpus larger than memory streams through.
        pending: collections.deque = collections.deque()
        for group in groups:
            pending.append(pool.apply_async(_tokenize, (group, tokenizer)))
            if len(pending) > 2 * workers:
                write(pending.popleft())
        while pending:
            write(pending.popleft())
        meta = writer.finish(tokenizer=tokenizer, source=source, path=pattern,
                             text_field=text_field)
    seconds = time.perf_counter() - started
    for line in problems.lines():
        print(line)
    tokens = meta["tokens"]
    print(f"{tokens:,} tokens in {seconds:.1f}s: {tokens / seconds:,.0f} tokens/s ({workers} "
          f"workers) -> {out}")
    return meta


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", help="a glob of files (quote it)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--source", choices=("text", "json", "parquet"), default="text")
    parser.add_argument("--text-field", default="text",
                        help="the column holding the text (json, parquet)")
    parser.add_argument("--tokenizer", default="bytes",
                        help="bytes, or a tokenizer.json or a directory holding one")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    try:
        # (nothing is overwritten: not an earlier output, and not a file the glob reads)
        for out in (args.out, Path(f"{args.out}.json")):
            check_new_output(out, text_paths(args.inputs, args.source))
        prepare(args.inputs, args.out, args.source, args.text_field, args.tokenizer, args.workers)
    except ConfigError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
