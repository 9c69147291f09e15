"""Train the user guide's small byte-level BPE tokenizer on a text corpus (how examples/tokenizer.json was made).

    python examples/make_tokenizer.py examples/corpus examples/tokenizer.json --vocab-size 512

The tiny presets have `model.vocab_size = 512`, and a run refuses token ids at or above it, so the tokenizer
they train with may hold at most 512 tokens (EOS included). For your own tokenizer, set `model.vocab_size` to
at least its size instead (`--set model.vocab_size=...`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def texts(corpus: Path):
    """The "text" of every record of every .jsonl file under corpus, in sorted path order."""
    for path in sorted(corpus.rglob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                yield json.loads(line)["text"]


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("corpus", type=Path, help="a folder of .jsonl files with a 'text' field")
    p.add_argument("out", type=Path, help="where to write tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=512)
    args = p.parse_args()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts(args.corpus), trainer)
    tok.save(str(args.out))
    print(f"wrote {args.out}: {tok.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
