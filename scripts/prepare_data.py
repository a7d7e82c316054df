"""Tokenizes a corpus once into the trainer's binary format: a flat array of token ids (uint16
when the vocabulary fits, else uint32) in OUT, described by OUT.json; train with
`data.source=binary data.path=OUT`.

    python scripts/prepare_data.py 'corpus/*.txt' data/corpus.bin [--tokenizer PATH|bytes] [--workers 4]

Each file is a document, followed by the tokenizer's end-of-sequence token, in sorted path order:
the same stream as `data.source=text data.path='corpus/*.txt'` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.data import text_paths  # noqa: E402
from trainer.errors import ConfigError  # noqa: E402
from trainer.tokenizer import build_tokenizer, tokenize_document  # noqa: E402

_tokenizer = None


def _start(spec: str) -> None:
    global _tokenizer
    _tokenizer = build_tokenizer(spec)


def _tokenize(path: str) -> np.ndarray:
    return np.array(tokenize_document(Path(path).read_text(errors="replace"), _tokenizer), dtype=np.int64)


def prepare(pattern: str, out: Path, tokenizer: str, workers: int) -> dict:
    paths = text_paths(pattern)
    tok = build_tokenizer(tokenizer)
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    started, tokens = time.perf_counter(), 0
    with Pool(workers, initializer=_start, initargs=(tokenizer,)) as pool, open(tmp, "wb") as f:
        progress = tqdm(total=sum(os.path.getsize(p) for p in paths), unit="B", unit_scale=True, desc="tokenizing")
        # imap keeps the files' order: the stream is the same with any number of workers.
        for path, ids in zip(paths, pool.imap(_tokenize, paths)):
            f.write(ids.astype(dtype).tobytes())
            tokens += len(ids)
            progress.update(os.path.getsize(path))
        progress.close()
    seconds = time.perf_counter() - started
    meta = {"dtype": np.dtype(dtype).name, "tokens": tokens, "vocab_size": tok.vocab_size, "tokenizer": tokenizer,
            "eos_id": tok.eos_id, "files": len(paths)}
    Path(f"{out}.json").write_text(json.dumps(meta, indent=1))
    tmp.rename(out)
    print(f"{tokens:,} tokens from {len(paths)} files in {seconds:.1f}s: {tokens / seconds:,.0f} tokens/s "
          f"({workers} workers) -> {out}")
    return meta


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", help="a glob of text files (quote it)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer", default="bytes", help="bytes, or a tokenizer.json or a directory holding one")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    try:
        prepare(args.inputs, args.out, args.tokenizer, args.workers)
    except ConfigError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
