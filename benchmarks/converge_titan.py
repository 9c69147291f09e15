"""The torchtitan 0.2.2 side of benchmarks/convergence.py: torchtitan's own DeepSeek-V3 model, parallelize
(activation checkpointing, torch.compile), AdamW builder with its aux-loss-free expert-bias hook, loss and
AMP context, run the way torchtitan's Trainer.train_step runs one step, on the SAME data (Spartron's loader,
any data-order seed) from the SAME Hugging Face initial weights (torchtitan's own state-dict adapter).

Not a copy of torchtitan: it imports it. Its settings that compute DeepSeek-V3's function are set
(`DIFFERENCES` lists each one, with what stays different); the learning rate of each step is Spartron's
schedule (`lr_at`) written into torchtitan's optimizer, so both follow one schedule by construction.
torchtitan's state is saved at the end of each invocation, a SIGTERM's included (model and optimizer by their
FQNs through torch.distributed.checkpoint.state_dict, loaded weights_only), so a case runs in pieces.
Needs CUDA: torchtitan's MoE router counts tokens with torch.histc on int64, which has no CPU kernel.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

# What was set so torchtitan computes DeepSeek-V3's function as Spartron does, and what stays different.
DIFFERENCES = {
    "set": {
        "moe.score_before_experts": "False (torchtitan's default True scales the expert INPUT; DeepSeek-V3 scales "
                                    "the output)",
        "moe.route_norm": "= model.moe.norm_topk_prob (DeepSeek-V3 normalises the top-k sigmoid scores)",
        "moe.route_scale / score_func / top_k / groups": "from the Spartron [model.moe]",
        "final norm eps": "= model.norm_eps (torchtitan builds its final RMSNorm without eps: finfo(dtype).eps)",
        "rope": "original_seq_len = seq_len, so no YaRN and no mscale (the Spartron preset has no [model.mla.yarn])",
        "weight decay": "torchtitan's one AdamW group split into Spartron's: matrices decay, vectors (norm "
                        "weights) do not (torchtitan decays every parameter)",
        "lr schedule": "Spartron's lr_at(step) written into torchtitan's optimizer each step",
        "loss normalisation": "one micro-batch per step: the sum over valid labels / their count, as Spartron",
    },
    "different": {
        "expert-bias rule": "torchtitan centres the update (delta - mean(delta)); Spartron does not. The two "
                            "differ by one constant added to every expert's bias, which top-k over scores + bias "
                            "ignores: the same routing up to fp32 rounding of near-ties",
        "router logits": "Spartron computes them in fp32 (model.moe.router_fp32 = true); torchtitan in the "
                         "compute dtype (bf16) and then the sigmoid in fp32",
        "fp32 masters": "torchtitan: fp32 parameters under torch.autocast (the residual stream stays fp32); "
                        "Spartron: bf16 compute copies (model.master_weights), the residual stream in bf16",
        "kernels": "attention (torchtitan: SDPA; Spartron: its MLA kernel), grouped GEMM, norms, AC policy "
                   "(torchtitan's per-op SAC, Spartron's selective targets), compile graphs",
    },
}


def unavailable() -> str | None:
    """Why torchtitan cannot run here (not installed, or no CUDA), or None."""
    try:
        import torchtitan  # noqa: F401
        from torchtitan.models.deepseek_v3 import DeepSeekV3Model  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means: not available
        return f"torchtitan not importable ({type(err).__name__}: {str(err)[:200]})"
    if not torch.cuda.is_available():
        return "no CUDA device (torchtitan's MoE router uses torch.histc on int64: no CPU kernel)"
    return None


def comparable_problems(m) -> list[str]:  # noqa: ANN001 - a spartron ModelConfig
    """Spartron [model] settings torchtitan's DeepSeek-V3 cannot compute (each names its key)."""
    out = []
    if m.mla.yarn is not None:
        out.append("model.mla.yarn is set (torchtitan's YaRN switches on only past original_seq_len)")
    if m.mtp.depth:
        out.append(f"model.mtp.depth = {m.mtp.depth} (torchtitan's DeepSeek-V3 has no MTP)")
    if m.tie_embeddings:
        out.append("model.tie_embeddings = true (torchtitan's head is its own)")
    if m.dsa is not None:
        out.append("model.dsa is set (torchtitan's DeepSeek-V3 has no sparse attention)")
    if m.moe.aux_loss_coeff:
        out.append(f"model.moe.aux_loss_coeff = {m.moe.aux_loss_coeff} (torchtitan uses only the expert bias)")
    return out


def model_args(m, seq_len: int):  # noqa: ANN001, ANN201 - ModelConfig -> DeepSeekV3ModelArgs
    """torchtitan's DeepSeekV3ModelArgs for the Spartron [model] (see DIFFERENCES["set"])."""
    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
    from torchtitan.models.moe import MoEArgs

    grouped = m.moe.n_groups > 1
    moe = MoEArgs(num_experts=m.moe.n_routed_experts, num_shared_experts=m.moe.n_shared_experts,
                  score_func=m.moe.score_func, route_norm=m.moe.norm_topk_prob, route_scale=m.moe.route_scale,
                  score_before_experts=False, top_k=m.moe.top_k,
                  num_expert_groups=m.moe.n_groups if grouped else None,
                  num_limited_groups=m.moe.topk_groups if grouped else None,
                  load_balance_coeff=m.moe.bias_update_rate or None)
    return DeepSeekV3ModelArgs(
        max_seq_len=seq_len, vocab_size=m.vocab_size, dim=m.dim, inter_dim=m.dense_inter_dim,
        moe_inter_dim=m.moe.moe_inter_dim, n_layers=m.n_layers, n_dense_layers=m.first_k_dense, n_heads=m.n_heads,
        norm_eps=m.norm_eps, moe_args=moe, q_lora_rank=m.mla.q_lora_rank, kv_lora_rank=m.mla.kv_lora_rank,
        qk_nope_head_dim=m.mla.qk_nope_head_dim, qk_rope_head_dim=m.mla.qk_rope_head_dim,
        v_head_dim=m.mla.v_head_dim, attn_type="sdpa", attn_mask_type="causal", original_seq_len=seq_len,
        rope_theta=m.mla.rope_theta)


def job_config(cfg, precision: str, compile_: bool, ac: str):  # noqa: ANN001, ANN201 - RunConfig -> JobConfig
    from torchtitan.config import JobConfig

    t = cfg.train
    jc = JobConfig()
    jc.model.name, jc.model.flavor = "deepseek_v3", "16B"
    jc.training.seq_len, jc.training.local_batch_size, jc.training.steps = t.seq_len, t.global_batch_size, t.steps
    jc.training.dtype = "float32" if precision == "fp32" else "bfloat16"
    jc.training.mixed_precision_param = "bfloat16"
    jc.training.max_norm = t.grad_clip
    jc.activation_checkpoint.mode = ac
    jc.activation_checkpoint.selective_ac_option = "op"
    jc.compile.enable, jc.compile.components = compile_, ["model", "loss"]
    o = jc.optimizer
    o.name, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay = "AdamW", t.lr, t.beta1, t.beta2, 1e-8, t.weight_decay
    o.implementation = "fused" if torch.cuda.is_available() else "foreach"
    return jc


def read_hf(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder (safetensors: no code runs)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def split_decay_groups(optimizers, weight_decay: float) -> None:  # noqa: ANN001 - OptimizersContainer
    """Each of torchtitan's AdamWs (one group of every parameter) becomes Spartron's two groups, before any state."""
    for opt in optimizers.optimizers:
        (group,) = opt.param_groups
        params = group.pop("params")
        opt.param_groups = [{**group, "params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                            {**group, "params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


class TitanCase:
    """One torchtitan run: build (or resume) in `case_dir`, step, evaluate, save."""

    def __init__(self, cfg, case_dir: Path, hf_dir: Path, precision: str, compile_: bool, ac: str) -> None:  # noqa: ANN001
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torchtitan.components.loss import build_cross_entropy_loss
        from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
        from torchtitan.config import TORCH_DTYPE_MAP
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.models.deepseek_v3 import DeepSeekV3Model, parallelize_deepseekv3
        from torchtitan.models.deepseek_v3.model.state_dict_adapter import DeepSeekV3StateDictAdapter
        from torchtitan.tools import utils as tt_utils

        cuda = torch.cuda.is_available()
        self.cfg, self.dir = cfg, case_dir
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        jc = job_config(cfg, precision, compile_, ac)
        pd = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
        args = model_args(cfg.model, cfg.train.seq_len)
        args.update_from_config(jc)
        with torch.device("meta"), tt_utils.set_default_dtype(TORCH_DTYPE_MAP[jc.training.dtype]):
            model = DeepSeekV3Model(args)
        model.norm.eps = args.norm_eps
        model = parallelize_deepseekv3(model, pd, jc)
        model.to_empty(device=self.device.type)
        with torch.no_grad():
            model.init_weights(buffer_device=None)  # freqs_cis; every parameter is overwritten next
        state = DeepSeekV3StateDictAdapter(args, None).from_hf(read_hf(hf_dir))
        set_model_state_dict(model, state, options=StateDictOptions(strict=True))
        model.train()
        self.model, self.loss_fn = model, build_cross_entropy_loss(jc)
        self.optimizers = build_optimizers_with_moe_load_balancing([model], jc.optimizer, pd)
        split_decay_groups(self.optimizers, cfg.train.weight_decay)
        self.amp = dist_utils.maybe_enable_amp(pd, jc.training.mixed_precision_param, self.device.type)
        self.clip = lambda: dist_utils.clip_grad_norm_(list(model.parameters()), jc.training.max_norm, foreach=True,
                                                       pp_mesh=None, ep_enabled=False)
        self.step_no = 0
        saved = case_dir / "titan-state.pt"
        if saved.is_file():
            self._load(saved)

    def _load(self, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        state = torch.load(path, map_location=self.device, weights_only=True)
        set_model_state_dict(self.model, state["model"])
        self.optimizers.load_state_dict(state["optimizer"])
        self.step_no = int(state["step"])

    def save(self) -> None:
        """The model (expert biases included) and optimizer by FQN, written to a temporary name then renamed."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        tmp = self.dir / "titan-state.pt.tmp"
        torch.save({"model": get_model_state_dict(self.model), "optimizer": self.optimizers.state_dict(),
                    "step": self.step_no}, tmp)
        tmp.replace(self.dir / "titan-state.pt")

    def _forward_loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from torchtitan.components.loss import IGNORE_INDEX

        valid = (labels != IGNORE_INDEX).sum()
        with self.amp:
            pred = self.model(tokens.to(self.device))
            loss = self.loss_fn(pred, labels.to(self.device)) / valid.to(self.device).float()
        return loss

    def step(self, batch, lr: float) -> dict:  # noqa: ANN001 - spartron.runtime.data.Batch
        """torchtitan's train_step for one micro-batch, at learning rate `lr`."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        for opt in self.optimizers.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        self.optimizers.zero_grad()
        loss = self._forward_loss(batch.tokens, batch.labels)
        loss.backward()
        grad_norm = self.clip()
        self.optimizers.step()  # its pre-hook updates the expert biases from the step's counts
        self.step_no += 1
        record = {"step": self.step_no, "loss": loss.item(), "grad_norm": float(grad_norm), "lr": lr}
        sync()
        record["step_time_s"] = time.perf_counter() - start
        return record

    @torch.no_grad()
    def evaluate(self, loader, n_batches: int, batch_size: int) -> float:  # noqa: ANN001 - TokenLoader
        """Spartron's Evaluator's value: the mean over the same held-out batches of each batch's mean LM loss
        (the routers' token counts restored afterwards, as Spartron restores its buffers)."""
        counts = {n: b.clone() for n, b in self.model.named_buffers() if n.endswith("tokens_per_expert")}
        loader.position = 0
        self.model.eval()
        total = 0.0
        for _ in range(n_batches):
            batch = loader.next(batch_size)
            total += float(self._forward_loss(batch.tokens, batch.labels))
        self.model.train()
        buffers = dict(self.model.named_buffers())
        for name, value in counts.items():
            buffers[name].copy_(value)
        return total / n_batches


def run(cfg, case_dir: Path, hf_dir: Path, precision: str, data_seed: int, steps_to: int, ac: str) -> None:  # noqa: ANN001
    """Train torchtitan from its saved step (or the initial weights) to `steps_to` on Spartron's data with the
    data-order seed `data_seed`; each step's record (and val_loss every train.eval_every) appended to
    case_dir/metrics.jsonl, the state saved at the end."""
    case_dir.mkdir(parents=True, exist_ok=True)
    own = not dist.is_initialized()
    if own:  # torchtitan's expert-bias hook builds its device mesh, which needs a process group: one rank, in memory
        dist.init_process_group("cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    try:
        train_titan(cfg, case_dir, hf_dir, precision, data_seed, steps_to, ac)
    finally:
        if own:
            dist.destroy_process_group()


def train_titan(cfg, case_dir: Path, hf_dir: Path, precision: str, data_seed: int, steps_to: int, ac: str) -> None:  # noqa: ANN001
    """run()'s body, inside a process group."""
    from spartron.runtime.data import build_eval_loader, build_train_loader
    from spartron.runtime.optim import lr_at
    from spartron.runtime.preemption import StopOnSigterm

    t = cfg.train
    seeded = cfg.model_copy(update={"train": t.model_copy(update={"seed": data_seed})})
    case = TitanCase(cfg, case_dir, hf_dir, precision, t.compile, ac)
    loader, evaluator = build_train_loader(seeded, 0, 1), build_eval_loader(seeded, 0, 1)
    loader.position = case.step_no * t.global_batch_size
    # a SIGTERM (a call's time limit) ends the loop after the step under way, and the state is saved below
    with StopOnSigterm() as stop, (case_dir / "metrics.jsonl").open("a") as log:
        while case.step_no < min(steps_to, t.steps) and not stop.requested:
            record = case.step(loader.next(t.global_batch_size), lr_at(case.step_no + 1, t))
            if not math.isfinite(record["loss"]):
                raise SystemExit(f"spartron: error: torchtitan's loss is {record['loss']} at step {record['step']}")
            if t.eval_every and (case.step_no % t.eval_every == 0 or case.step_no == t.steps):
                record["val_loss"] = case.evaluate(evaluator, t.eval_steps, t.global_batch_size)
            cuda = torch.cuda.is_available()
            record["peak_memory_allocated_bytes"] = torch.cuda.max_memory_allocated() if cuda else 0
            log.write(json.dumps(record) + "\n")
            log.flush()
    with contextlib.suppress(FileNotFoundError):
        (case_dir / "titan-state.pt.tmp").unlink()
    case.save()
