"""Bridges between Spartron and other ecosystems' model formats (Hugging Face: `spartron.interop.hf`)."""
