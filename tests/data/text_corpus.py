"""A tiny tokenizer trained on the fly (tokenizers, WordLevel) and small corpora: nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<unk>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
WORDS = ("the cat sat on a mat and dog ran to big red house we saw it in park why not yes no what is "
         "two plus three four five six seven eight nine ten").split()


def make_tokenizer(path: Path, words: list[str] | None = None, specials: tuple[str, ...] = ()) -> Path:
    """tokenizer.json of a WordLevel tokenizer over `words` (whitespace split, the chat headers as specials)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=[*SPECIALS, *specials])
    tok.train_from_iterator([" ".join(words or WORDS)], trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def text(i: int, n: int) -> str:
    """Document i: n words drawn deterministically from WORDS."""
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n))


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def text_folder(root: Path, n_docs: int = 40, files: int = 2) -> Path:
    """A folder of jsonl files holding n_docs documents of 5..40 words, split over `files` files."""
    for f in range(files):
        write_jsonl(root / f"part-{f}.jsonl", [{"text": text(i, 5 + (i * 11) % 36)}
                                               for i in range(f, n_docs, files)])
    return root
