"""Multi-token prediction (DeepSeek-V3 style).

Depth k predicts token i+k+1 at position i: it combines the previous depth's hidden state (norm) with
the embedding of token i+k (norm), projects 2*dim -> dim, runs one decoder layer, and scores with the
model's shared head. One block can serve every depth (`share_weights`). DSA ids flow explicitly: the
main stack's last ids go into depth 1 and each depth hands its ids to the next (with
`model.dsa.share_indexer_across_mtp` the indexer runs at the first depth and the others consume its
ids). The loop over depths is MTP's own, not the decoder stack's: each depth also takes a new
embedding and is scored by the head.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from spartron.comm.transport import EPTransport
from spartron.layers.attention.dsa import dsa_schedule, ids_for_layer
from spartron.layers.config import ModelConfig
from spartron.layers.decoder import DecoderLayer
from spartron.layers.norms import RMSNorm
from spartron.layers.outputs import MTPOutput


class MTPBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, transport: EPTransport | None = None, cp_group=None,
                 *, moe_micro_batches: int = 1):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.embed_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.layer = DecoderLayer(cfg, layer_idx, transport, cp_group, moe_micro_batches=moe_micro_batches)
        self.final_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)

    def forward(self, h_prev: Tensor, embedded: Tensor, positions: Tensor, dsa_topk_ids: Tensor | None):
        h = self.proj(torch.cat([self.hidden_norm(h_prev), self.embed_norm(embedded)], dim=-1))
        return self.layer(h, positions, dsa_topk_ids=dsa_topk_ids)


def shift_left(x: Tensor, k: int, fill: int) -> Tensor:
    """x[:, i] <- x[:, i + k]; the last k positions get `fill`."""
    if k == 0:
        return x
    pad = torch.full_like(x[:, :k], fill)
    return torch.cat([x[:, k:], pad], dim=1)


class MTP(nn.Module):
    """`depth` prediction blocks (or one shared block); returns hidden states and losses per depth.

    Under torch.compile, a weight-shared block with `model.dsa.share_indexer_across_mtp` compiles two
    graphs: depth 0 is a DSA source (no ids in, its indexer runs) and every later depth a consumer
    (the ids in, the indexer skipped), two programs of one module. Dynamo tells them apart by the
    guard `dsa_topk_ids is None`; the main stack's consumer graph cannot serve the later depths
    either, since those layers own no indexer and have `dsa_role == "consumer"`. It costs one more
    trace at the first step, nothing per step (both graphs stay cached). Without the shared indexer
    every depth is a source and the block runs one graph.
    """

    def __init__(self, cfg: ModelConfig, transport: EPTransport | None = None, cp_group=None,
                 *, moe_micro_batches: int = 1):
        super().__init__()
        self.depth = cfg.mtp.depth
        self.loss_scale = cfg.mtp.loss_scale
        n_blocks = 1 if cfg.mtp.share_weights else self.depth
        # MTP layers are numbered after the main stack so the DSA schedule treats them as their own group.
        self.blocks = nn.ModuleList(MTPBlock(cfg, cfg.n_layers + i, transport, cp_group,
                                             moe_micro_batches=moe_micro_batches) for i in range(n_blocks))
        self.dsa_roles = dsa_schedule(cfg)[cfg.n_layers:]  # depth 0 computes ids, later depths may reuse

    def block(self, k: int) -> MTPBlock:
        return self.blocks[0] if len(self.blocks) == 1 else self.blocks[k]

    def forward(self, h: Tensor, embed_at_depth, positions: Tensor, dsa_topk_ids: Tensor | None,
                loss_at_depth) -> tuple[MTPOutput, list]:
        """embed_at_depth(k) -> embeddings of tokens shifted by k; loss_at_depth(k, hidden) -> scalar.

        Returns the MTPOutput and the decoder-layer outputs (for aux losses and router counts).
        """
        hidden, losses, layer_outputs = [], [], []
        ids = dsa_topk_ids
        for k in range(self.depth):
            out = self.block(k)(h, embed_at_depth(k + 1), positions, ids_for_layer(self.dsa_roles[k], ids))
            layer_outputs.append(out)
            h = out["hidden_states"]
            ids = out["dsa_topk_ids"] if out["dsa_topk_ids"] is not None else ids
            hidden.append(h)
            losses.append(self.loss_scale / self.depth * loss_at_depth(k + 1, self.block(k).final_norm(h)))
        return MTPOutput(hidden_states=hidden, losses=losses, dsa_topk_ids=ids), layer_outputs
