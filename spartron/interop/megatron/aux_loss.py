"""The MoE balance loss through Megatron's own aux-loss machinery.

Megatron's router attaches its load-balancing loss to the MoE output with `MoEAuxLossAutoScaler`
(backward adds d(aux) scaled by the schedule's loss scale / num_microbatches, so no loss function
has to add it, on any pipeline stage) and logs `aux / coeff` per layer with
`save_to_aux_losses_tracker` ("load_balancing_loss", or "seq_load_balancing_loss" for the sequence
loss), which Megatron's `track_moe_metrics` reports. The MoE adapter does the same with Spartron's
balance loss, and its SideChannel record carries `aux_loss=None` (side.loss() must not add it again).

Definitions (`aux_loss_definition`): both are sum_i f_i * P_i with f_i the routed-token fraction of
expert i and P_i its mean normalised score, per batch or per sequence, and equal whenever routing is
a plain top-k of the scores. They differ in which top-k f_i counts:
- "spartron" (default, what Spartron's own trainer optimises): the experts the tokens were routed
  to, i.e. after the expert bias and group-limited routing;
- "megatron": a plain top-k of the unbiased scores, ignoring bias and groups (Megatron's
  compute_routing_scores_for_aux_loss). Megatron also adds 1e-20 to the sigmoid-score sum.
Both count over this rank's tokens only (config.py refuses an aux loss with context parallelism,
where Megatron counts over the whole sequence).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from spartron.checkpointing.replay import reuse_during_recompute
from spartron.layers.config import MoEConfig
from spartron.layers.moe.router import load_balancing_loss
from spartron.layers.outputs import MoEOutput

AuxLossDefinition = Literal["spartron", "megatron"]
DEFINITIONS: tuple[str, ...] = ("spartron", "megatron")
TRACKER_NAMES = {"batch": "load_balancing_loss", "seq": "seq_load_balancing_loss"}


def check_definition(definition: str) -> None:
    if definition not in DEFINITIONS:
        raise ValueError(f"aux_loss_definition must be one of {list(DEFINITIONS)}, got {definition!r}")


def balance_loss(out: MoEOutput, cfg: MoEConfig, batch: int, definition: str) -> Tensor | None:
    """The layer's balance loss (times aux_loss_coeff) under `definition`; None without one."""
    if out["aux_loss"] is None or definition == "spartron":
        return out["aux_loss"]
    scores = out["router_scores"]
    plain = scores.topk(cfg.top_k, dim=-1).indices
    n_seq = batch if cfg.aux_loss_type == "seq" else 1
    return cfg.aux_loss_coeff * load_balancing_loss(scores, plain, n_seq, cfg.score_func, cfg.top_k)


def attach_and_track(hidden: Tensor, aux: Tensor, cfg: MoEConfig, layer_number: int, num_layers: int,
                     reduce_group: dist.ProcessGroup | None, training: bool, per_token_loss: bool = False) -> Tensor:
    """`hidden` carrying `aux`'s gradient (training with grad only, as Megatron's router), and `aux /
    coeff` in Megatron's tracker once per layer call: in the original pass of a Spartron checkpoint
    region, never in its replay.

    `per_token_loss` (Megatron's calculate_per_token_loss): the schedule then no longer divides the aux gradient
    by the micro-batches and finalize_model_grads divides every gradient by the step's target count, so the
    gradient's aux is weighed by the layer's token count, as Megatron's router does (1 / (micro-batches x
    ranks) of the step when every position is a target); the tracked value stays the layer's own."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, save_to_aux_losses_tracker

    if not training:
        return hidden
    # Once per layer call: inside a checkpoint region (apply_spartron_checkpointing) the tracker's
    # in-place update runs in the original pass only and is not part of the region's replayed ops.
    reuse_during_recompute(save_to_aux_losses_tracker, TRACKER_NAMES[cfg.aux_loss_type],
                           aux.detach() / cfg.aux_loss_coeff, layer_number, num_layers, reduce_group=reduce_group)
    if torch.is_grad_enabled():
        hidden = MoEAuxLossAutoScaler.apply(hidden, aux * hidden.shape[0] * hidden.shape[1] if per_token_loss
                                            else aux)
    return hidden
