"""The config recorded with a saved state (`state_config`) and what a resume says when this run's differs:
refused (the optimizer's own settings), a note per training option, or a note per other change."""

from __future__ import annotations

from typing import Any

# The train.* options stored in the optimizer's state (its kind and param_groups): a resume must match them.
STATE_TRAIN_KEYS = ("optimizer", "beta1", "beta2", "weight_decay")
# What the saved data position means (with every train.data.* key): a change is reported when resuming.
DATA_TRAIN_KEYS = ("seed", "seq_len", "global_batch_size")
# How training proceeds from the step on: a resume that changes one prints a note naming it (`training_notes`).
TRAINING_TRAIN_KEYS = ("lr", "warmup_steps", "min_lr_ratio", "steps", "grad_clip", "micro_batch_size",
                       "intra_layer_micro_batches", "intra_layer_micro_batch_scope", "grad_sync", "adamw_kernel",
                       "adamw_moments_dtype", "muon_ns_dtype", "compile", "max_loss", "loss_spike_factor")


def _flatten(data: Any, prefix: str) -> dict[str, Any]:
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}.{key}"))
        return out
    return {prefix: data}


def state_config(cfg: Any) -> dict[str, Any]:
    """Dotted key -> value of the options recorded with a saved state (cfg: a RunConfig)."""
    flat = _flatten(cfg.model.model_dump(mode="json"), "model")
    flat.update({f"train.{key}": getattr(cfg.train, key)
                 for key in STATE_TRAIN_KEYS + DATA_TRAIN_KEYS + TRAINING_TRAIN_KEYS})
    flat.update(_flatten(cfg.train.data.model_dump(mode="json"), "train.data"))
    return flat


def config_changes(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """'key (saved A, this run B)' for every dotted key under prefix whose value differs; a section set on one side
    and off (None) on the other is one entry, its keys as a table (model.fp8 (saved {...}, this run None))."""
    missing = "<unset>"

    def shown(key: str) -> str:  # the key, or the section above it that one side records as a value
        parts = key.split(".")
        return next((a for a in (".".join(parts[:i]) for i in range(1, len(parts))) if a in saved or a in now), key)

    def value(flat: dict[str, Any], key: str) -> Any:
        if key in flat:
            return flat[key]
        table = {k[len(key) + 1:]: v for k, v in flat.items() if k.startswith(key + ".")}
        return table or missing

    keys = sorted({shown(k) for k in set(saved) | set(now) if k.startswith(prefix)})
    return [f"{k} (saved {value(saved, k)!r}, this run {value(now, k)!r})"
            for k in keys if value(saved, k) != value(now, k)]


def refused_change(change: str) -> bool:
    return change.split(" ", 1)[0] in {f"train.{key}" for key in STATE_TRAIN_KEYS}


def _training(change: str) -> bool:
    return change.split(" ", 1)[0] in {f"train.{key}" for key in TRAINING_TRAIN_KEYS}


def recorded_changes(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """config_changes, less the keys the saved step recorded nothing of (neither the key nor a section above or
    below it: a step saved before the key was recorded, or by `convert --from-hf`, says nothing of it)."""
    def recorded(key: str) -> bool:
        parts = key.split(".")
        return any(".".join(parts[:i]) in saved for i in range(1, len(parts) + 1)) or \
            any(k.startswith(key + ".") for k in saved)

    return [c for c in config_changes(saved, now, prefix) if recorded(c.split(" ", 1)[0])]


def resume_notes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The recorded settings that differ but do not stop a resume: model.* keys whose tensors still fit
    (checked by load_state), and what the data position means (seed, sequence length, batch, data file).
    How training proceeds (lr, grad_clip, ...) is `training_notes`'."""
    return [c for c in recorded_changes(saved, now) if not refused_change(c) and not _training(c)]


def training_notes(saved: dict[str, Any], now: dict[str, Any], skip: tuple[str, ...] = ()) -> list[str]:
    """One `spartron: note:` line per train.* option of TRAINING_TRAIN_KEYS the saved step recorded with
    another value than this run's (a step saved before a key was recorded says nothing of it); `skip`: dotted
    keys another line already names."""
    return [f"spartron: note: {key} changed on resume: the saved step trained with {saved[key]!r}, this run uses "
            f"{now.get(key)!r}"
            for key in (f"train.{k}" for k in TRAINING_TRAIN_KEYS)
            if key in saved and key not in skip and saved[key] != now.get(key)]


def seq_len_note(saved: dict[str, Any], now: dict[str, Any], consumed: int, fingerprint: str) -> str | None:
    """What a resume with another train.seq_len does to the data: the position is a count of samples (`consumed`,
    over all dp ranks), so on a token stream the next sample starts elsewhere than where the saved run stopped
    (tokens skipped or read again); a shuffled stream's remaining samples of the epoch are other windows. None
    when the length is unchanged, nothing was consumed or the data is synthetic (generated per sample)."""
    old, new = saved.get("train.seq_len"), now.get("train.seq_len")
    if old is None or old == new or not consumed or fingerprint.startswith("synthetic"):
        return None
    head = (f"spartron: note: train.seq_len changed on resume ({old} -> {new}) and the data position is a count of "
            f"samples ({consumed} read): ")
    if ":shuffled:" in fingerprint:
        return head + ("the epoch's remaining samples are windows of the new length in their own shuffled order, "
                       "not the data the saved run had left unread")
    where, was = consumed * new, consumed * old
    what = f"tokens {was}-{where - 1} are skipped" if where > was else f"tokens {where}-{was - 1} are read again"
    return head + f"this run reads from token {where} of the stream, where the saved run stopped at {was}: {what}"
