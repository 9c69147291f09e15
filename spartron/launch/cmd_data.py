"""`spartron data`: tokenize a corpus (jsonl / parquet / text file or folder) into a token folder.

The tokenizing lives in spartron.data (prepare_corpus); this module reports progress, and SIGTERM
unwinds like Ctrl-C so the partial output is removed and the folder is as it was.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from spartron.launch.command import Terminated, UsageError, raise_terminated


def cmd_data(args: argparse.Namespace) -> int:
    """Tokenize a corpus (jsonl / parquet / text file or folder) into a token folder (spartron.data)."""
    import time

    from spartron.data import prepare_corpus

    last = [time.monotonic()]

    def progress(documents: int, tokens: int) -> None:  # a line every 10 s on a long corpus
        if time.monotonic() - last[0] >= 10:
            last[0] = time.monotonic()
            print(f"spartron data: {documents} documents, {tokens} tokens", file=sys.stderr, flush=True)

    if args.text_key in ("", "messages"):
        raise UsageError(f"--text-key {args.text_key!r}: name the text field of pretraining records ('messages' "
                         "holds chats)")
    previous = signal.signal(signal.SIGTERM, raise_terminated)  # as Ctrl-C: the partial output is removed
    try:
        meta = prepare_corpus(args.corpus, args.tokenizer, args.out, eos_token=args.eos, text_key=args.text_key,
                              bos_token=args.bos, progress=progress, chat_format=args.chat_format)
    except (KeyboardInterrupt, Terminated) as err:
        name = "SIGTERM" if isinstance(err, Terminated) else "SIGINT"
        print(f"spartron: data: stopped by {name}; removed the partial output ({args.out} is as it was: run the "
              "same command again)", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
    skipped = meta["corpus"]["skipped_files"]
    if skipped:
        from spartron.data.corpus import SUFFIXES

        shown = ", ".join(skipped[:5]) + (f", ... ({len(skipped) - 5} more)" if len(skipped) > 5 else "")
        print(f"spartron: note: {len(skipped)} file(s) of {args.corpus} are not corpus files and were not read "
              f"({shown}): spartron data reads {', '.join(SUFFIXES)}", file=sys.stderr)
    print(f"spartron: wrote {meta['n_tokens']} tokens ({meta['dtype']}) of {meta['n_documents']} documents to "
          f"{args.out}; train on it with train.data.kind = \"packed\" and train.data.path = {json.dumps(args.out)} "
          f"(model.vocab_size >= {meta['vocab_size']})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="tokenize a text corpus into a token folder for train.data.kind = 'packed'",
                       description="Tokenize CORPUS (a .jsonl / .jsonl.gz / .parquet / .txt file or a folder of "
                                   "them: records "
                                   "with 'text', or chat 'messages') with a local tokenizer into DIR: tokens.bin, "
                                   "loss_mask.bin (chats) and tokens.json (dtype, vocabulary, tokenizer hash, "
                                   "document offsets).")
    p.add_argument("corpus", help="a corpus file or folder")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json, or a folder saved by transformers")
    p.add_argument("--out", required=True, metavar="DIR", help="new (or empty) output folder")
    p.add_argument("--eos", help="the end-of-document token (default: eos_token of tokenizer_config.json)")
    p.add_argument("--bos", help="a token starting every document (default: bos_token of tokenizer_config.json "
                                 "when it sets add_bos_token; else none)")
    p.add_argument("--text-key", default="text", help="the text field of pretraining records (default text)")
    p.add_argument("--chat-format", default="spartron",
                   help="how chats are rendered: spartron (default), chatml or deepseek (spartron/data/tokenizer.py)")
    p.set_defaults(func=cmd_data)
