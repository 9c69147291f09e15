"""Text data: local corpora (jsonl, parquet, text), a local tokenizer, Spartron's token folders and the
packing of documents into training sequences (per-document positions, document boundaries, SFT loss
masks). The trainer's loaders are in spartron.runtime.data; `spartron data` writes token folders."""

from spartron.data.corpus import Chat, Document, corpus_files, read_corpus
from spartron.data.packing import PackedDocuments, split_documents
from spartron.data.prepare import prepare_corpus
from spartron.data.tokenfile import TokenFolder, open_token_folder, token_dtype, write_token_folder
from spartron.data.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Chat", "Document", "PackedDocuments", "TokenFolder", "Tokenizer", "corpus_files", "load_tokenizer",
           "open_token_folder", "prepare_corpus", "read_corpus", "split_documents", "token_dtype",
           "write_token_folder"]
