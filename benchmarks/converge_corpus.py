"""The convergence benchmarks' real-text corpus: the documentation Debian packages install, tokenized by
`spartron data`, prepared once under a root folder that convergence.py and dsa_stages.py share.

Any Debian or Ubuntu machine has /usr/share/doc, but not the same files: what was read is recorded
(every file's path and byte count, the total and the corpus's SHA-256) so a result names its corpus.
Read: each package's copyright, README*, changelog* and NEWS* (gzipped ones decompressed), regular
files only (no links), UTF-8 only (others counted, not read). One document per file, ordered by the
SHA-256 of its path, so the held-out split (`train.data.val_fraction`: the LAST documents) is a fixed
pseudo-random sample of packages rather than the alphabet's tail; the order does not depend on which
other files a machine has. The tokenizer is a byte-level BPE trained on the corpus by
examples/make_tokenizer.py (the project's way of making one), then `spartron data` tokenizes.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC_NAMES = re.compile(r"^(copyright|README[^/]*|changelog[^/]*|NEWS[^/]*)$")
MAX_FILE_BYTES = 256 << 10  # one file's text at most: the few huge changelogs would dominate the corpus


def doc_files(doc_root: Path) -> list[Path]:
    """The candidate files under doc_root: regular files (not links) named like DOC_NAMES, sorted."""
    out = []
    for path in sorted(doc_root.rglob("*")):
        name = path.name[:-3] if path.name.endswith(".gz") else path.name
        if DOC_NAMES.match(name) and path.is_file() and not path.is_symlink():
            out.append(path)
    return out


def read_text(path: Path) -> str | None:
    """The file's text (gzip decompressed, at most MAX_FILE_BYTES), or None when it is not UTF-8 or unreadable."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        else:
            with path.open("rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        return raw[:MAX_FILE_BYTES].decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError):
        return None


def build_corpus(doc_root: Path, out_dir: Path, max_bytes: int) -> dict:
    """Write out_dir/corpus.jsonl (one {"text"} record per file, in path-hash order, until max_bytes of text)
    and return its description: files (relative path, bytes), totals, skipped counts, SHA-256."""
    files = doc_files(doc_root)
    ordered = sorted(files, key=lambda p: hashlib.sha256(str(p.relative_to(doc_root)).encode()).hexdigest())
    out_dir.mkdir(parents=True, exist_ok=True)
    used, total, skipped = [], 0, {"not_utf8_or_unreadable": 0, "empty": 0, "over_max_bytes": 0}
    digest = hashlib.sha256()
    with (out_dir / "corpus.jsonl").open("w", encoding="utf-8") as f:
        for path in ordered:
            text = read_text(path)
            if text is None:
                skipped["not_utf8_or_unreadable"] += 1
                continue
            if not text.strip():
                skipped["empty"] += 1
                continue
            size = len(text.encode("utf-8"))
            if total + size > max_bytes:  # the cap ends the corpus (no hunt for smaller files after it)
                skipped["over_max_bytes"] = len(ordered) - ordered.index(path)
                break
            line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
            f.write(line)
            digest.update(line.encode("utf-8"))
            used.append([str(path.relative_to(doc_root)), size])
            total += size
    if not used:
        print(f"spartron: error: no readable documentation file under {doc_root}", file=sys.stderr)
        raise SystemExit(2)
    return {"doc_root": str(doc_root), "candidates": len(files), "documents": len(used), "text_bytes": total,
            "max_bytes": max_bytes, "skipped": skipped, "sha256": digest.hexdigest(), "files": used}


def cli(*args: str) -> None:
    """Run a `spartron` command in a child process (its one-line error and exit status, as a user sees them)."""
    done = subprocess.run([sys.executable, "-m", "spartron.launch.cli", *args], cwd=REPO, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"spartron {args[0]} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")


def prepare(root: Path, vocab_size: int, max_bytes: int, doc_root: Path = Path("/usr/share/doc")) -> dict:
    """root/corpus (the jsonl and corpus.json), root/tokenizer/tokenizer.json, root/tok (`spartron data`), each
    made once: a second call reads what the first wrote (the token folder is the sign it finished)."""
    info_path = root / "corpus" / "corpus.json"
    tok_dir = root / "tok"
    if (tok_dir / "tokens.json").is_file() and info_path.is_file():
        return json.loads(info_path.read_text())
    info = build_corpus(doc_root, root / "corpus", max_bytes)
    tokenizer = root / "tokenizer" / "tokenizer.json"
    tokenizer.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(REPO / "examples" / "make_tokenizer.py"), str(root / "corpus"), str(tokenizer),
                    "--vocab-size", str(vocab_size)], check=True, cwd=REPO, capture_output=True)
    cli("data", str(root / "corpus"), "--tokenizer", str(tokenizer), "--eos", "<eos>", "--out", str(tok_dir))
    meta = json.loads((tok_dir / "tokens.json").read_text())
    info.update(tokenizer={"kind": "byte-level BPE (examples/make_tokenizer.py)", "vocab_size": vocab_size,
                           "sha256": hashlib.sha256(tokenizer.read_bytes()).hexdigest()},
                tokens={key: meta.get(key) for key in ("n_tokens", "n_documents", "dtype", "vocab_size")})
    info_path.write_text(json.dumps(info, indent=1) + "\n")
    return info

