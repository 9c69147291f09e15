"""Bridges between Spartron and other ecosystems: Hugging Face checkpoints in and out
(`spartron.interop.hf`) and Spartron's layers inside megatron-core models (`spartron.interop.megatron`).
Each bridge is its own face; they import on first use (spartron.face), so using one does not load the other.
"""

from spartron.face import lazy_face

_NAMES = {
    "HFCheckpointError": "hf", "HFConfigError": "hf", "check_config_matches": "hf", "export_hf": "hf",
    "import_hf": "hf",
    "MegatronConfigError": "megatron", "SideChannel": "megatron", "megatron_config_from_spartron": "megatron",
    "spartron_block_spec": "megatron",
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_face(__name__, _NAMES)
