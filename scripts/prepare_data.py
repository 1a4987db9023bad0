#!/usr/bin/env python
"""Pre-tokenize a local corpus into the flat ``tokens`` format that ``data=tokens`` reads.

    scripts/prepare_data.py INPUT [INPUT ...] --output DATA.bin [--tokenizer tokenizer.json]
                            [--eos-token TOKEN] [--workers N] [--docs-per-chunk N]

INPUTs are .txt / .jsonl (a "text" field) / .parquet (a "text" column) files, folders or glob
patterns. Writes DATA.bin (uint16 ids when the largest id fits, else uint32; documents joined
by the EOS token) and DATA.bin.json (tokenizer, vocab_size, eos_id, dtype, num_tokens,
num_documents), which the recipe checks. Tokenizes in worker processes with bounded memory.
Both files are written as NAME.partial and renamed into place when complete; an output that is
(or resolves to) an input is refused, and so is a NAME.partial left by an interrupted run (the
error says to delete it).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _cli import OneLineParser, fail, positive_int  # noqa: E402

from hyper_parallel._optional import MissingDependency, require  # noqa: E402
from hyper_parallel.data import prepare_tokens  # noqa: E402


def main(argv: list[str]) -> int:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("--output", required=True)
    parser.add_argument("--tokenizer", default="bytes", help="bytes, or a local tokenizer.json")
    parser.add_argument("--eos-token", default=None)
    parser.add_argument("--workers", type=positive_int, default=max(1, min(8, (os.cpu_count() or 1) - 1)))
    parser.add_argument("--docs-per-chunk", type=positive_int, default=256)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        tqdm = require("tqdm", "scripts/prepare_data.py").tqdm
    except MissingDependency as err:
        return fail(str(err))

    text_bytes = 0
    with tqdm(unit=" docs", disable=args.quiet, dynamic_ncols=True) as bar:
        def progress(docs: int, nbytes: int) -> None:
            nonlocal text_bytes
            text_bytes += nbytes
            bar.update(docs)
            bar.set_postfix_str(f"{text_bytes / 1e6:,.1f} MB of text", refresh=False)

        try:
            meta = prepare_tokens(args.inputs, args.output, tokenizer=args.tokenizer, eos_token=args.eos_token,
                                  workers=args.workers, docs_per_chunk=args.docs_per_chunk, progress=progress)
        except (OSError, ValueError, MissingDependency) as err:
            bar.close()
            return fail(str(err))
    print(f"{meta['num_documents']:,} documents -> {meta['num_tokens']:,} {meta['dtype']} tokens "
          f"(vocab_size {meta['vocab_size']:,}: set model.vocab_size to at least that) in {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
