"""THE parameter-name table between transformers' DeepSeek-V3 / V3.2 checkpoints and SparseMoEModel.

One function, `tensor_map(cfg)`, lists every tensor of both sides as `Piece`s: a box of a Spartron
tensor (its 1-rank global shape) equals a box of one HF tensor. Import and export both read this
list, so a name can never map one way and not the other. What is not one to one:

- routed experts: Spartron stacks them (`ffn.experts.w1/w3/w2` [E, out, in]); HF checkpoints hold
  `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` per expert (what `save_pretrained` writes and
  DeepSeek publishes) or, stacked, `mlp.experts.gate_up_proj` [E, 2I, D] (gate rows first) and
  `mlp.experts.down_proj` [E, D, I]: `stacked=True` maps the stacked form;
- MTP depth k is HF layer `num_hidden_layers + k` (DeepSeek-V3's `model.layers.61`): `enorm`,
  `hnorm`, `eh_proj`, `shared_head.norm` and a decoder layer. DeepSeek concatenates
  [enorm(embedding), hnorm(hidden)] before `eh_proj`, Spartron [hidden, embedding]: the two column
  halves swap. The layer's `embed_tokens` and `shared_head.head` are copies of the model's own
  (`copies`): Spartron shares them, writes them back on export and checks them on import;
- the router's `e_score_correction_bias` is Spartron's `router.expert_bias` buffer (fp32);
- with `n_shared_experts = 0` transformers (and DeepSeek's own modelling code) still builds the shared-expert
  MLP, of width 0, and saves its three weights with zero elements; Spartron has no such module. They are
  `empty`: accepted on import when present (shape checked), written on export so transformers finds every
  tensor it expects;
- DeepSeek-V3.2's indexer (`self_attn.indexer.wq_b / wk / k_norm / weights_proj`, transformers'
  DeepseekV32ForCausalLM names, which are the published DeepSeek-V3.2 names) maps name for name.
"""

from __future__ import annotations

from dataclasses import dataclass

from spartron.layers.config import ModelConfig, dsa_layers

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension


@dataclass(frozen=True)
class Piece:
    """`spartron[dst] == hf[src]`; when the Spartron tensor has one more dim, dst's first range has
    length 1 (one expert of a stack) and that dim is dropped."""

    spartron: str
    hf: str
    dst: Box
    src: Box
    hf_shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorMap:
    pieces: tuple[Piece, ...]
    shapes: dict[str, tuple[int, ...]]  # every Spartron tensor (params and the expert-bias buffers)
    copies: dict[str, str]  # HF name -> the Spartron tensor it duplicates (MTP embed / head)
    # HF name -> (the Spartron tensor whose dtype it is exported in, its zero-element shape): tensors of no
    # values that only the HF side has (zero shared experts: module docstring)
    empty: dict[str, tuple[str, tuple[int, ...]]]

    def by_spartron(self) -> dict[str, list[Piece]]:
        out: dict[str, list[Piece]] = {}
        for p in self.pieces:
            out.setdefault(p.spartron, []).append(p)
        return out

    def by_hf(self) -> dict[str, list[Piece]]:
        out: dict[str, list[Piece]] = {}
        for p in self.pieces:
            out.setdefault(p.hf, []).append(p)
        return out

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {p.hf: p.hf_shape for p in self.pieces}
        shapes.update({hf: self.shapes[s] for hf, s in self.copies.items()})
        shapes.update({hf: shape for hf, (_, shape) in self.empty.items()})
        return shapes


def _whole(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


class _Builder:
    def __init__(self) -> None:
        self.pieces: list[Piece] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.empty: dict[str, tuple[str, tuple[int, ...]]] = {}

    def same(self, spartron: str, hf: str, *shape: int) -> None:
        self.shapes[spartron] = shape
        self.pieces.append(Piece(spartron, hf, _whole(shape), _whole(shape), shape))

    def add(self, spartron: str, shape: tuple[int, ...], hf: str, dst: Box, src: Box, hf_shape: tuple[int, ...]):
        self.shapes[spartron] = shape
        self.pieces.append(Piece(spartron, hf, dst, src, hf_shape))


def _decoder_layer(b: _Builder, cfg: ModelConfig, s: str, h: str, moe: bool, indexer: bool, stacked: bool) -> None:
    d, mla = cfg.dim, cfg.mla
    heads, qk = cfg.n_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
    b.same(f"{s}attn_norm.weight", f"{h}input_layernorm.weight", d)
    b.same(f"{s}ffn_norm.weight", f"{h}post_attention_layernorm.weight", d)
    a, ha = f"{s}attn.", f"{h}self_attn."
    if mla.q_lora_rank:
        b.same(f"{a}wq_a.weight", f"{ha}q_a_proj.weight", mla.q_lora_rank, d)
        b.same(f"{a}q_norm.weight", f"{ha}q_a_layernorm.weight", mla.q_lora_rank)
        b.same(f"{a}wq_b.weight", f"{ha}q_b_proj.weight", heads * qk, mla.q_lora_rank)
    else:
        b.same(f"{a}wq.weight", f"{ha}q_proj.weight", heads * qk, d)
    b.same(f"{a}wkv_a.weight", f"{ha}kv_a_proj_with_mqa.weight", mla.kv_lora_rank + mla.qk_rope_head_dim, d)
    b.same(f"{a}kv_norm.weight", f"{ha}kv_a_layernorm.weight", mla.kv_lora_rank)
    b.same(f"{a}wkv_b.weight", f"{ha}kv_b_proj.weight", heads * (mla.qk_nope_head_dim + mla.v_head_dim),
           mla.kv_lora_rank)
    b.same(f"{a}wo.weight", f"{ha}o_proj.weight", d, heads * mla.v_head_dim)
    if indexer:
        dsa, i, hi = cfg.dsa, f"{a}indexer.", f"{ha}indexer."
        b.same(f"{i}wq_b.weight", f"{hi}wq_b.weight", dsa.n_index_heads * dsa.index_head_dim, mla.q_lora_rank or d)
        b.same(f"{i}wk.weight", f"{hi}wk.weight", dsa.index_head_dim, d)
        b.same(f"{i}k_norm.weight", f"{hi}k_norm.weight", dsa.index_head_dim)
        b.same(f"{i}k_norm.bias", f"{hi}k_norm.bias", dsa.index_head_dim)
        b.same(f"{i}weights_proj.weight", f"{hi}weights_proj.weight", dsa.n_index_heads, d)
    f, hm = f"{s}ffn.", f"{h}mlp."
    if not moe:
        inter = cfg.dense_inter_dim
        for ours, theirs, shape in (("w1", "gate_proj", (inter, d)), ("w3", "up_proj", (inter, d)),
                                    ("w2", "down_proj", (d, inter))):
            b.same(f"{f}{ours}.weight", f"{hm}{theirs}.weight", *shape)
        return
    m = cfg.moe
    n, inter = m.n_routed_experts, m.moe_inter_dim
    b.same(f"{f}router.weight", f"{hm}gate.weight", n, d)
    b.same(f"{f}router.expert_bias", f"{hm}gate.e_score_correction_bias", n)
    shared = m.n_shared_experts * inter
    for ours, theirs, shape in (("w1", "gate_proj", (shared, d)), ("w3", "up_proj", (shared, d)),
                                ("w2", "down_proj", (d, shared))):
        if shared:
            b.same(f"{f}shared_experts.{ours}.weight", f"{hm}shared_experts.{theirs}.weight", *shape)
        else:  # transformers' width-0 shared MLP (module docstring): the routed experts' dtype on export
            b.empty[f"{hm}shared_experts.{theirs}.weight"] = (f"{f}experts.w2", shape)
    w13, w2 = (n, inter, d), (n, d, inter)
    if stacked:
        gate_up = (n, 2 * inter, d)
        b.add(f"{f}experts.w1", w13, f"{hm}experts.gate_up_proj", _whole(w13), ((0, n), (0, inter), (0, d)), gate_up)
        b.add(f"{f}experts.w3", w13, f"{hm}experts.gate_up_proj", _whole(w13),
              ((0, n), (inter, 2 * inter), (0, d)), gate_up)
        b.add(f"{f}experts.w2", w2, f"{hm}experts.down_proj", _whole(w2), _whole(w2), w2)
        return
    for e in range(n):
        for ours, theirs, shape in (("w1", "gate_proj", w13), ("w3", "up_proj", w13), ("w2", "down_proj", w2)):
            one = shape[1:]
            b.add(f"{f}experts.{ours}", shape, f"{hm}experts.{e}.{theirs}.weight",
                  ((e, e + 1),) + _whole(one), _whole(one), one)


def tensor_map(cfg: ModelConfig, stacked: bool = False) -> TensorMap:
    """Every tensor of SparseMoEModel(cfg) and of the HF checkpoint, piece by piece (module docstring).

    `stacked`: the checkpoint stores routed experts stacked (gate_up_proj / down_proj).
    """
    b = _Builder()
    d, v = cfg.dim, cfg.vocab_size
    b.same("embed.weight", "model.embed_tokens.weight", v, d)
    b.same("norm.weight", "model.norm.weight", d)
    head = "embed.weight"
    if not cfg.tie_embeddings:
        b.same("head.weight", "lm_head.weight", v, d)
        head = "head.weight"
    indexed = set(dsa_layers(cfg)) if cfg.dsa is not None else set()
    for i in range(cfg.n_layers):
        _decoder_layer(b, cfg, f"layers.{i}.", f"model.layers.{i}.", i >= cfg.first_k_dense, i in indexed, stacked)
    copies: dict[str, str] = {}
    mtp_indexer = cfg.dsa is not None and cfg.dsa.layers in ("moe", "all")
    for k in range(cfg.mtp.depth):
        block = 0 if cfg.mtp.share_weights else k
        s, h = f"mtp.blocks.{block}.", f"model.layers.{cfg.n_layers + k}."
        b.same(f"{s}embed_norm.weight", f"{h}enorm.weight", d)
        b.same(f"{s}hidden_norm.weight", f"{h}hnorm.weight", d)
        b.same(f"{s}final_norm.weight", f"{h}shared_head.norm.weight", d)
        proj = (d, 2 * d)
        b.add(f"{s}proj.weight", proj, f"{h}eh_proj.weight", ((0, d), (0, d)), ((0, d), (d, 2 * d)), proj)
        b.add(f"{s}proj.weight", proj, f"{h}eh_proj.weight", ((0, d), (d, 2 * d)), ((0, d), (0, d)), proj)
        # An MTP block's indexer: every depth's own (share_indexer_across_mtp = false), else depth 0's.
        own_indexer = mtp_indexer and (k == 0 or not cfg.dsa.share_indexer_across_mtp)
        _decoder_layer(b, cfg, f"{s}layer.", h, True, own_indexer, stacked)
        copies[f"{h}embed_tokens.weight"] = "embed.weight"
        copies[f"{h}shared_head.head.weight"] = head
    return TensorMap(pieces=tuple(b.pieces), shapes=b.shapes, copies=copies, empty=b.empty)


def mtp_layer_indices(hf_names, n_layers: int) -> list[int]:
    """The MTP depths (0, 1, ...) whose HF layer `n_layers + k` has tensors among `hf_names`."""
    found = set()
    for name in hf_names:
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
            if int(parts[2]) >= n_layers:
                found.add(int(parts[2]) - n_layers)
    return sorted(found)
