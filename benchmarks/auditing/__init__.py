"""The audit's cases, one module per surface (benchmarks/audit.py runs them)."""
