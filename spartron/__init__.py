"""Spartron: a distributed training runtime for sparse MoE models with DSA sparse attention."""

__version__ = "0.1.0"
