"""Train a megatron-core GPTModel whose layers are Spartron's, through Megatron's own training machinery.

    torchrun --nproc-per-node 2 examples/megatron_gpt.py --save /tmp/mgpt   # 2 gloo ranks (or 2 GPUs)
    python examples/megatron_gpt.py --nproc 2 --save /tmp/mgpt              # the same; spawns its ranks
    python examples/megatron_gpt.py --nproc 2 --load /tmp/mgpt --steps 5        # resume: steps 4 and 5
    python examples/megatron_gpt.py --nproc 4 --ep 4 --load /tmp/mgpt --model-only --steps 0   # EP 4 weights

What a Megatron user writes: `parallel_state` with an expert-parallel size, a GPTModel built from
`spartron_block_spec` (Spartron MLA / DSA attention and MoE behind Megatron's ModuleSpecs), Megatron's
DistributedDataParallel and optimizer, `get_forward_backward_func` over micro-batches and
`finalize_model_grads` (which also updates the routers' expert bias), and `dist_checkpointing` save
and load of model, optimizer and data position (each EP rank saves its own experts; the weights load
under any EP size, `MegatronTraining.load` says when the optimizer state does).
The model is configs/tiny.toml's without MTP; the data is Spartron's synthetic loader.

A step's loss is the exact token mean over all its micro-batches and data-parallel ranks, as Spartron's own
Trainer computes it (spartron.runtime.loss_norm) and the way Megatron-LM does it: `calculate_per_token_loss`,
forward_step's loss function returns (sum of the micro-batch's target losses, its target count, ...), and
Megatron's schedule and finalize_model_grads divide the gradients by the step's all-reduced target count. A mean
of micro-batch means weighed an all-prompt chat window (no target) like a full one, so the step's loss and
gradient depended on how its samples fell into micro-batches and ranks.

On CPU: megatron-core 0.16.1 creates a few bookkeeping tensors on "cuda" by name (DDP buffers, schedule
and optimizer scalars); this script then uses the test-only tests/interop/megatron/cpu_shim.py, which
says exactly what it redirects. On GPUs Megatron runs unpatched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spartron.interop.megatron import (  # noqa: E402
    SideChannel,
    megatron_config_from_spartron,
    spartron_block_spec,
)
from spartron.layers.init import init_tensor_  # noqa: E402
from spartron.layers.loss import IGNORE_INDEX  # noqa: E402
from spartron.runtime.config import RunConfig, load_config  # noqa: E402
from spartron.runtime.data import Batch, build_train_loader  # noqa: E402
from spartron.runtime.optim import lr_at  # noqa: E402

TINY = REPO / "configs" / "tiny.toml"
TIMEOUT = timedelta(minutes=5)  # a rank that fails leaves the others in a collective: they end after this
DEFAULTS = ["device=cpu", "model.mtp.depth=0", "model.n_layers=3", "ac.mode=none", "train.seq_len=32",
            "train.micro_batch_size=1", "train.global_batch_size=4", "train.warmup_steps=0",
            "train.grad_clip=0", "train.progress=false"]


def megatron_device(device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """The context Megatron's DDP / optimizer / schedule / dist_checkpointing calls run in on `device`."""
    if device.type == "cuda":
        return contextlib.nullcontext
    sys.path.insert(0, str(REPO / "tests" / "interop" / "megatron"))
    from cpu_shim import cpu_megatron  # test-only: see the module docstring

    return cpu_megatron


class MegatronTraining:
    """GPTModel with Spartron's layers, wrapped and stepped by megatron-core as in Megatron-LM.

    `cfg`: a Spartron run config (its model, its train.* optimizer settings, its data); `ep`: Megatron's
    expert_model_parallel_size (parallel_state is initialised here if it is not yet); `bf16`: the model in
    bfloat16 under Megatron's Float16Module with fp32 master weights; `distributed_optimizer`: Megatron's; `ddp`:
    more DistributedDataParallelConfig fields (overlap_grad_reduce, overlap_param_gather, bucket_size, ...).
    """

    def __init__(self, cfg: RunConfig, ep: int, *, bf16: bool = False, distributed_optimizer: bool = False,
                 device: torch.device | None = None, ddp: dict | None = None):
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.module import Float16Module

        self.cfg, m, t = cfg, cfg.model, cfg.train
        self.device = device or torch.device("cpu")
        self.megatron_device = megatron_device(self.device)
        if bf16:  # the same model in bfloat16: Megatron's bf16 and params_dtype
            m = m.model_copy(update={"dtype": "bfloat16"})
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
        self.pgc = ProcessGroupCollection.use_mpu_process_groups()  # the groups every Megatron module uses
        tcfg = megatron_config_from_spartron(m, use_cpu_initialization=True, expert_model_parallel_size=ep,
                                             calculate_per_token_loss=True)  # the step's token mean (docstring)
        self.side = SideChannel()  # DSA ids, indexer loss and router counts of one forward
        # Built under the training device: Spartron's layers draw their initial values there, with that
        # device's generator, as Spartron's Trainer does (CPU and CUDA generators give different values)
        with torch.device(self.device):
            gpt = GPTModel(tcfg, self.block_spec(tcfg, m),
                           vocab_size=m.vocab_size, max_sequence_length=m.max_seq_len, position_embedding_type="none",
                           share_embeddings_and_output_weights=m.tie_embeddings, pg_collection=self.pgc)
        self.gpt = gpt.to(self.device)
        with torch.no_grad():  # Megatron-owned weights drawn as Spartron's model draws them: the same model
            init_tensor_(gpt.embedding.word_embeddings.weight, "embed.weight", t.seed, m.init_std)
            if not m.tie_embeddings:
                init_tensor_(gpt.output_layer.weight, "head.weight", t.seed, m.init_std)
        wrapped = Float16Module(tcfg, self.gpt) if bf16 else self.gpt  # how Megatron trains in bf16
        with self.megatron_device():
            self.model = DistributedDataParallel(
                tcfg, DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                                    grad_reduce_in_fp32=bf16, **(ddp or {})),
                wrapped, pg_collection=self.pgc)
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=t.lr, weight_decay=t.weight_decay, adam_beta1=t.beta1,
                                adam_beta2=t.beta2, adam_eps=1e-8, clip_grad=t.grad_clip, bf16=bf16,
                                use_distributed_optimizer=distributed_optimizer),
                [self.model], use_gloo_process_groups=False, pg_collection=self.pgc)
        tcfg.finalize_model_grads_func = finalize_model_grads  # DP reductions and the expert-bias update
        tcfg.no_sync_func = self.model.no_sync
        dp_rank, dp = dist.get_rank(self.pgc.dp), dist.get_world_size(self.pgc.dp)
        self.loader = build_train_loader(cfg, dp_rank, dp)
        self.n_micro = t.micro_steps(dp)

    def block_spec(self, tcfg, m):  # noqa: ANN001, ANN201 - Megatron's config and Spartron's ModelConfig
        """The TransformerBlock spec: Spartron's layers (benchmarks swap in Megatron's MoE here)."""
        return spartron_block_spec(tcfg, self.side, base_config=m, pg_collection=self.pgc,
                                   init_seed=self.cfg.train.seed)

    def forward_step(self, data_iterator: Iterator, model: torch.nn.Module):
        """Megatron's forward_step_func. Its loss function returns Megatron's per-token triple: the sum of the
        LM loss over the micro-batch's targets (labels != -100: a chat's prompt is none), their count, and for
        the report [that sum, the count]; Megatron divides the step's gradients by the count summed over
        micro-batches and data-parallel ranks (calculate_per_token_loss). The SideChannel's indexer loss weighs
        the micro-batch's token count, as Megatron's router weighs its aux loss under that setting (the MoE
        adapter does the same): 1 / (micro-batches x ranks) of the step, as in Spartron's Trainer, when every
        position is a target."""
        batch = next(data_iterator)
        if batch.positions is not None:  # GPTModel here takes no document positions: plain causal attention
            raise ValueError("packed documents (Batch.positions) are not passed to Megatron's GPTModel here")
        self.side.reset()
        targets = (batch.labels != IGNORE_INDEX).to(self.device)
        labels = batch.labels.masked_fill(batch.labels == IGNORE_INDEX, 0)  # Megatron's CE reads every label
        per_token = model(batch.tokens.to(self.device), None, None, labels=labels.to(self.device))

        def loss_func(output: torch.Tensor):
            loss = (output.float() * targets).sum() + self.side.loss() * batch.tokens.numel()
            count = targets.sum().to(torch.int)
            return loss, count, {"loss": torch.stack([loss.detach(), count.float()])}

        return per_token, loss_func

    def _batches(self) -> Iterator:
        while True:
            yield self.loader.next(self.cfg.train.micro_batch_size)

    def step(self, step: int, batches: Iterator[Batch] | None = None) -> float:
        """One optimizer step (1-based) over this rank's micro-batches (`batches`, default the config's loader);
        the loss is the step's token mean over every micro-batch and data-parallel rank (forward_step)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        t = self.cfg.train
        with self.megatron_device():
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            out = get_forward_backward_func()(
                forward_step_func=self.forward_step, data_iterator=batches or self._batches(), model=[self.model],
                num_microbatches=self.n_micro, seq_length=t.seq_len, micro_batch_size=t.micro_batch_size)
            for group in self.optimizer.param_groups:  # what Megatron's OptimizerParamScheduler sets, on
                group["lr"] = lr_at(step, t) * group["lr_mult"]  # Spartron's lr schedule
                group["weight_decay"] = t.weight_decay * group["wd_mult"]  # vectors: 0, as in Spartron
            ok, _, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError(f"step {step}: the Megatron optimizer skipped the update")
        total = torch.stack([o["loss"] for o in out]).sum(dim=0)  # [loss sum, targets] of this rank's step
        dist.all_reduce(total, group=self.pgc.dp_cp)
        return (total[0] / total[1].clamp(min=1)).item()

    def eval_loss(self, seed: int = 7) -> float:
        """The LM loss of one fixed batch (the same tokens on every rank), without gradients."""
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.cfg.model.vocab_size, (2, self.cfg.train.seq_len + 1), generator=gen)
        tokens = tokens.to(self.device)
        self.side.reset()
        self.gpt.eval()  # the routers count training forwards only (the expert-bias update reads the counts)
        try:
            with torch.no_grad():
                return self.gpt(tokens[:, :-1], None, None, labels=tokens[:, 1:]).float().mean().item()
        finally:
            self.gpt.train()

    def _state(self, is_loading: bool = False) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        model = self.gpt.sharded_state_dict()
        data = ShardedObject("data_position", self.loader.state_dict(), (self.loader.dp_size,),
                             (self.loader.dp_rank,), replica_id=0)  # one object per data-parallel rank
        return {"model": model, "optimizer": self.optimizer.sharded_state_dict(model, is_loading=is_loading),
                "data": data}

    def save(self, path: Path, step: int) -> None:
        """dist_checkpointing save after optimizer step `step`: model, optimizer, the data position
        (collective; every rank writes its own shards, each EP rank its own experts)."""
        from megatron.core import dist_checkpointing

        path.mkdir(parents=True, exist_ok=True)  # an existing, empty folder on every rank
        with self.megatron_device():
            state = self._state()
            state["step"] = step
            dist_checkpointing.save(state, str(path))

    def load(self, path: Path, model_only: bool = False) -> int:
        """dist_checkpointing load into this set-up (collective); returns the saved step (the next
        `step()` is that + 1). The model loads under any EP size and world size. A full resume (optimizer
        and data position too) needs the saved data-parallel size, and an EP size > 1 on both sides when
        they differ: Megatron splits expert and dense optimizers only when EP > 1 (for its own MoE layers
        too). `model_only`: the weights alone, starting at step 0 (a fine-tuning start)."""
        from megatron.core import dist_checkpointing

        with self.megatron_device():
            state = self._state(is_loading=True)
            if model_only:
                state = {"model": state["model"]}
            loaded = dist_checkpointing.load(state, str(path))
            self.gpt.load_state_dict(loaded["model"])
            if model_only:
                return 0
            self.optimizer.load_state_dict(loaded["optimizer"])
        self.loader.load_state_dict(loaded["data"])
        return loaded["step"]


def run(args: argparse.Namespace) -> dict:
    """The example on this rank: optional load, training up to step --steps, optional save and a reload."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cfg = load_config(TINY, [*DEFAULTS, f"parallel.ep={args.ep}", f"train.steps={args.schedule_steps}",
                             f"train.global_batch_size={dist.get_world_size() * args.micro_batches}"])
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    job = MegatronTraining(cfg, args.ep, device=device)
    result: dict = {"world": dist.get_world_size(), "ep": args.ep, "micro_batches": job.n_micro, "losses": {}}
    start = 0
    if args.load:
        start = job.load(args.load, model_only=args.model_only)
        result["loaded_eval_loss"] = job.eval_loss()
        say(f"loaded step {start} from {args.load} under EP {args.ep}: eval loss {result['loaded_eval_loss']:.6f}")
    save_at = args.save_at or args.steps
    for step in range(start + 1, args.steps + 1):
        result["losses"][step] = job.step(step)
        say(f"step {step}: loss {result['losses'][step]:.6f}")
        if args.save and step == save_at:
            save_and_reload(job, cfg, args.save, step, result, device, say)
    result["eval_loss"] = job.eval_loss()
    say(f"eval loss after step {args.steps}: {result['eval_loss']:.6f}")
    return result


def save_and_reload(job: MegatronTraining, cfg: RunConfig, path: Path, step: int, result: dict,
                    device: torch.device, say: Callable) -> None:
    """Save after `step`, then load the save into a freshly initialised set-up: every tensor must come back."""
    job.save(path, step)
    other = MegatronTraining(cfg.model_copy(update={"train": cfg.train.model_copy(update={"seed": 1})}),
                             cfg.parallel.ep, device=device)  # another init: the load must replace every tensor
    other.load(path)
    mine = job.gpt.state_dict()
    result["saved_eval_loss"], result["reload_eval_loss"] = job.eval_loss(), other.eval_loss()
    result["reload_differing"] = sorted(k for k, v in other.gpt.state_dict().items()
                                        if isinstance(v, torch.Tensor) and not torch.equal(v, mine[k]))
    say(f"saved step {step} in {path}; a fresh model loaded it: eval loss {result['reload_eval_loss']:.6f} "
        f"(saved model: {result['saved_eval_loss']:.6f}), {len(result['reload_differing'])} tensors differ on "
        f"rank 0")


def _rank_main(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    """A spawned rank (--nproc): the process group from a file store, then the example."""
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        _finish(run(args), args)
    finally:
        dist.destroy_process_group()


def _finish(result: dict, args: argparse.Namespace) -> None:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0 and args.out:
        args.out.write_text(json.dumps({"ranks": gathered}, indent=1) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=None, help="spawn this many ranks (without torchrun)")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel size (divides the world size)")
    p.add_argument("--steps", type=int, default=3, help="train up to this optimizer step")
    p.add_argument("--schedule-steps", type=int, default=8, help="length of the lr schedule (train.steps)")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per rank and step")
    p.add_argument("--save", type=Path, default=None, help="dist_checkpointing folder to write (and reload)")
    p.add_argument("--save-at", type=int, default=None, help="the step after which to --save (default: --steps)")
    p.add_argument("--load", type=Path, default=None, help="dist_checkpointing folder to start from")
    p.add_argument("--model-only", action="store_true", help="--load only the weights (start at step 0)")
    p.add_argument("--out", type=Path, default=None, help="JSON of every rank's results")
    args = p.parse_args()
    if args.nproc is None:  # torchrun (or one plain process)
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=TIMEOUT)
        try:
            _finish(run(args), args)
        finally:
            dist.destroy_process_group()
        return 0
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="megatron_gpt_") as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, args.nproc, f"{tmp}/store", args))
                 for r in range(args.nproc)]
        for proc in procs:
            proc.start()
        while any(proc.is_alive() for proc in procs):  # one rank failing ends the others at once
            if any(proc.exitcode not in (None, 0) for proc in procs):
                for proc in procs:
                    proc.kill()
            time.sleep(0.1)
    failed = [r for r, proc in enumerate(procs) if proc.exitcode != 0]
    if failed:
        print(f"megatron_gpt: ranks {failed} failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
