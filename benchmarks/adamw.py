"""AdamW with the gradient clip on the dsv3-12l parameter shapes: torch's fused AdamW, the clip (foreach mul)
plus torch's fused AdamW, and TritonAdamW (train.adamw_kernel = "triton": clip coefficient and update in one
pass), against the device's measured copy bandwidth.

    python benchmarks/adamw.py --commit SHA --out benchmarks/results/adamw/adamw_SHA.json
    python benchmarks/adamw.py --smoke     # tiny shapes on the CPU (Triton rows only with TRITON_INTERPRET=1)

The parameters are the preset's own (the model built on the meta device: names, shapes, dtype), allocated on
the device with random gradients; the optimizers come from spartron.runtime.optim.build_optimizer and step
through clip_and_step_, exactly what the Trainer calls. First a correctness check on a subset of the tensors
(embedding, head, norms, layers 0 and 1: the same per-tensor sizes) in bf16 and with fp32 masters: 3 steps of
TritonAdamW against torch's fused AdamW, with and without clipping; then every timed row steps the full
parameter set --steps times after --warmup untimed steps, each step timed alone by CUDA events (the host's
bookkeeping included, as the trainer's step has it: its norm is read before the optimizer runs), plus the
host time to enqueue it. Bytes per step: param, grad, exp_avg, exp_avg_sq read, param and both moments written.
The bf16 rows (the preset's bf16-only run) include a sweep of kernel configs; "fp32 masters" rows time fp32
parameters, gradients and state (model.master_dtype = "float32") on the embedding, head and layers 0-5.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_name, write_report  # noqa: E402

from spartron.layers.model import build_model  # noqa: E402
from spartron.runtime.config import load_config  # noqa: E402
from spartron.runtime.optim import build_optimizer, clip_and_step_  # noqa: E402

MAX_NORM = 1.0
SWEEP = [dict(block=1024, iters=8, num_warps=4), dict(block=1024, iters=1, num_warps=4),
         dict(block=2048, iters=4, num_warps=8), dict(block=4096, iters=2, num_warps=8),
         dict(block=4096, iters=4, num_warps=16), dict(block=512, iters=16, num_warps=2),
         dict(block=1024, iters=8, num_warps=4, per_tensor_min_numel=0),
         dict(block=1024, iters=8, num_warps=4, per_tensor_min_numel=1 << 20)]


def preset_shapes(config: Path) -> list[tuple[str, tuple[int, ...]]]:
    cfg = load_config(config)
    model = build_model(cfg.model, device="meta")
    return [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]


def subset(shapes: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """Everything outside the decoder stack plus layers 0 (dense) and 1 (MoE): every distinct tensor size."""
    return [(n, s) for n, s in shapes if not n.startswith("layers.") or n.split(".")[1] in ("0", "1")]


def make(shapes, dtype: torch.dtype, device: torch.device, seed: int) -> nn.ParameterList:  # noqa: ANN001
    g = torch.Generator(device).manual_seed(seed)
    params = nn.ParameterList()
    for _, shape in shapes:
        p = nn.Parameter(torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype) * 0.02)
        p.grad = (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 1e-3).to(dtype)
        params.append(p)
    return params


def run_config(kernel: str, lr: float):  # noqa: ANN201
    from spartron.runtime.config import TrainConfig

    return TrainConfig(adamw_kernel=kernel, lr=lr, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=MAX_NORM)


def optimizer(params: nn.ParameterList, kernel: str, lr: float) -> torch.optim.Optimizer:
    """build_optimizer's; on the CPU (--smoke under Triton's interpreter, which build_optimizer refuses) a
    TritonAdamW over the same groups."""
    if kernel == "torch" or params[0].is_cuda:
        return build_optimizer(params, run_config(kernel, lr))
    from spartron.runtime.adamw_triton import TritonAdamW

    groups = build_optimizer(params, run_config("torch", lr)).param_groups
    return TritonAdamW([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups], lr=lr,
                       betas=(0.9, 0.95), eps=1e-8)


def reference_steps(p0: torch.Tensor, g0: torch.Tensor, dtype: torch.dtype, wd: float, lr: float, coef: float,
                    steps: int) -> tuple[torch.Tensor, ...]:
    """torch's AdamW formula in float64 on flat slices, the state rounded to `dtype` after each step as it is
    stored (the gradient scaled in float64, unrounded)."""
    p, g = p0.double(), g0.double() * coef
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, steps + 1):
        p = p * (1 - lr * wd)
        m = m + 0.1 * (g - m)
        v = 0.95 * v + 0.05 * g * g
        p = p - lr / (1 - 0.9**step) * m / (v.sqrt() / (1 - 0.95**step) ** 0.5 + 1e-8)
        p, m, v = (t.to(dtype).double() for t in (p, m, v))
    return p, m, v


def check(shapes, dtype: torch.dtype, device: torch.device, clip: bool, steps: int = 3,  # noqa: ANN001
          slice_len: int = 1 << 16) -> dict:
    """TritonAdamW vs torch's fused AdamW after `steps` steps on the same parameters and gradients: their
    difference, and each one's error against a float64 reference on the first `slice_len` elements of every
    tensor (relative to that tensor's largest reference value); ok when Triton's error is at most twice the
    fused kernel's plus the dtype's eps (one rounding of the largest value) for params and both moments, and
    every step count is `steps`."""
    from spartron.runtime.adamw_triton import TritonAdamW

    lr = 1e-2
    ref, mine = make(shapes, dtype, device, 0), make(shapes, dtype, device, 0)
    grads = [p.grad.clone() for p in ref]
    starts = [(p.detach().reshape(-1)[:slice_len].clone(), g.reshape(-1)[:slice_len].clone())
              for p, g in zip(ref, grads, strict=True)]
    ref_opt, mine_opt = optimizer(ref, "torch", lr), optimizer(mine, "triton", lr)
    assert isinstance(mine_opt, TritonAdamW) and not isinstance(ref_opt, TritonAdamW)
    norm = torch.tensor(2.7 if clip else 0.5, device=device)  # above / below MAX_NORM
    coef = float(torch.clamp(MAX_NORM / (norm.double() + 1e-6), max=1.0)) if clip else 1.0
    for _ in range(steps):
        for p, q, g in zip(ref, mine, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        clip_and_step_(ref_opt, list(ref), MAX_NORM, norm, float(norm))
        clip_and_step_(mine_opt, list(mine), MAX_NORM, norm, float(norm))
    out: dict = {"dtype": str(dtype).removeprefix("torch."), "clip": clip, "steps": steps, "tensors": len(shapes),
                 "params": sum(p.numel() for p in ref), "slice_len": slice_len}
    errors = {k: {"torch": 0.0, "triton": 0.0} for k in ("param", "exp_avg", "exp_avg_sq")}
    for i, (p, q) in enumerate(zip(ref, mine, strict=True)):
        wd = 0.1 if p.ndim >= 2 else 0.0
        expect = dict(zip(("param", "exp_avg", "exp_avg_sq"), reference_steps(*starts[i], dtype, wd, lr, coef, steps),
                          strict=True))
        for key in errors:
            got = {"torch": p if key == "param" else ref_opt.state[p][key],
                   "triton": q if key == "param" else mine_opt.state[q][key]}
            e = expect[key]
            scale = float(e.abs().max()) or 1.0
            for name, t in got.items():
                err = float((t.detach().reshape(-1)[:slice_len].double() - e).abs().max()) / scale
                errors[key][name] = max(errors[key][name], err)
    for key in errors:
        pairs = [(p, q) if key == "param" else (ref_opt.state[p][key], mine_opt.state[q][key])
                 for p, q in zip(ref, mine, strict=True)]
        diffs = [(a.detach().float() - b.detach().float()).abs() for a, b in pairs]
        out[key] = {"max_abs_diff_vs_torch": max(float(d.max()) for d in diffs),
                    "fraction_differing_from_torch": sum(int((d > 0).sum()) for d in diffs) / out["params"],
                    "rel_error_vs_fp64": errors[key]}
    out["steps_ok"] = all(float(mine_opt.state[q]["step"]) == steps for q in mine)
    eps = torch.finfo(dtype).eps
    out["ok"] = out["steps_ok"] and all(e["triton"] <= 2 * e["torch"] + eps for e in errors.values())
    return out


def copy_ceiling(device: torch.device, gib: float, iters: int) -> dict:
    n = int(gib * 2**30) // 2
    buffers = [torch.empty(n, dtype=torch.bfloat16, device=device).normal_(), torch.empty(n, dtype=torch.bfloat16,
                                                                                          device=device)]
    times = timed(lambda: buffers[1].copy_(buffers[0]), 3, iters, device)
    buffers.clear()
    best = min(times)
    return {"bytes_per_copy": 2 * 2 * n, "times_ms": times, "median_ms": statistics.median(times),
            "tb_per_s_median": 4 * n / statistics.median(times) / 1e9, "tb_per_s_best": 4 * n / best / 1e9}


def timed(fn, warmup: int, iters: int, device: torch.device, host: list | None = None) -> list[float]:  # noqa: ANN001
    """ms of each of `iters` single calls after `warmup`, device synchronised before each (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            times.append((t1 - t0) * 1e3)
        if host is not None:
            host.append((t1 - t0) * 1e3)
    return times


def row(name: str, times: list[float], host: list[float], bytes_per_step: int, ceiling: float | None,
        **extra) -> dict:  # noqa: ANN003
    med = statistics.median(times)
    tbs = bytes_per_step / med / 1e9
    return {"name": name, **extra, "bytes_per_step": bytes_per_step, "times_ms": times, "host_ms": host,
            "median_ms": med, "min_ms": min(times), "median_host_ms": statistics.median(host), "tb_per_s": tbs,
            "fraction_of_copy_ceiling": tbs / ceiling if ceiling else None}


def time_rows(report: dict, prefix: str, shapes, dtype: torch.dtype, device: torch.device,  # noqa: ANN001
              ceiling: float | None, sweep: bool, triton_ok: bool, args: argparse.Namespace, save) -> None:  # noqa: ANN001
    """Rows for one parameter set: torch fused AdamW with and without the clip pass, TritonAdamW (+ the sweep)."""
    params = make(shapes, dtype, device, 1)
    n = sum(p.numel() for p in params)
    bytes_per_step = n * params[0].element_size() * 7  # param, grad, exp_avg, exp_avg_sq read; 3 written
    norm = torch.tensor(2.0, device=device)  # above MAX_NORM: the clip coefficient is 0.5
    plist = list(params)

    def timed_row(name: str, fn, **extra) -> None:  # noqa: ANN001, ANN003
        name = prefix + name
        try:
            host: list[float] = []
            times = timed(fn, args.warmup, args.steps, device, host)
            report["rows"].append(row(name, times, host, bytes_per_step, ceiling, dtype=str(dtype).removeprefix(
                "torch."), params=n, **extra))
            r = report["rows"][-1]
            print(f"{name:92s} {r['median_ms']:8.2f} ms  host {r['median_host_ms']:6.2f} ms  {r['tb_per_s']:6.3f} TB/s"
                  + (f"  {r['fraction_of_copy_ceiling']:.1%} of copy" if ceiling else ""))
        except Exception as err:  # noqa: BLE001 - record and go on with the other rows
            report["errors"].append(f"{name}: {type(err).__name__}: {err}")
            traceback.print_exc()
        save()

    torch_opt = [optimizer(params, "torch", 8e-4)]
    timed_row("torch fused AdamW (no clip)", torch_opt[0].step)
    # this row scales the grads in place by 0.5 a step (0.5**14 * 1e-3 is still a normal bf16)
    timed_row("clip (foreach mul) + torch fused AdamW",
              lambda: clip_and_step_(torch_opt[0], plist, MAX_NORM, norm, 2.0))
    torch_opt.clear()  # its state, before TritonAdamW allocates its own
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not triton_ok:
        return
    from spartron.runtime.adamw_triton import AdamWKernelConfig

    opt = optimizer(params, "triton", 8e-4)
    default = opt.kernel
    timed_row("TritonAdamW clip + AdamW (default config)", lambda: clip_and_step_(opt, plist, MAX_NORM, norm, 2.0),
              kernel=vars(default).copy())
    timed_row("TritonAdamW no clip (default config)", opt.step, kernel=vars(default).copy())
    for kw in SWEEP if sweep else []:
        opt.kernel = AdamWKernelConfig(**kw)
        own = kw.get("per_tensor_min_numel")
        label = f"block {kw['block']} x{kw['iters']} warps {kw['num_warps']}" + (
            "" if own is None else f", own launch from {own} elements")
        timed_row(f"TritonAdamW clip + AdamW ({label})", lambda: clip_and_step_(opt, plist, MAX_NORM, norm, 2.0),
                  kernel=vars(opt.kernel).copy())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "dsv3-12l.toml")
    ap.add_argument("--commit", default=None, help="the commit the tree is at (the device copy's git lies)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-sweep", action="store_true", help="time the default TritonAdamW config only")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    triton_ok = cuda or os.environ.get("TRITON_INTERPRET") == "1"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version, triton_ok = None, False
    shapes = preset_shapes(args.config)
    if args.smoke:
        shapes = [("layers.0.w", (48, 16)), ("layers.0.norm", (16,)), ("head", (40, 16))]
        args.steps, args.warmup = 10, 1
    report: dict = {"benchmark": "adamw", "device": device_name(cuda), "torch": torch.__version__,
                    "cuda": torch.version.cuda, "triton": triton_version, "commit": args.commit,
                    "config": str(args.config),
                    "tensors": len(shapes), "params": sum(torch.Size(s).numel() for _, s in shapes),
                    "steps": args.steps, "warmup": args.warmup, "checks": [], "rows": [], "errors": []}

    def save() -> None:
        write_report(args.out, report)

    if triton_ok:
        for dtype, clip in [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)]:
            try:
                part = subset(shapes) if not args.smoke else shapes
                if dtype == torch.float32 and not args.smoke:  # fp32 masters: layers 0 and 1 only (28 B / param)
                    part = [(n, s) for n, s in part if n.startswith("layers.")]
                report["checks"].append(check(part, dtype, device, clip))
                print("check", report["checks"][-1])
            except Exception as err:  # noqa: BLE001 - record and go on: the timings are still wanted
                report["errors"].append(f"check {dtype} clip={clip}: {type(err).__name__}: {err}")
                traceback.print_exc()
            if cuda:
                torch.cuda.empty_cache()
        save()
    ceiling = None
    if cuda:
        report["copy"] = copy_ceiling(device, 4.0, args.steps)
        ceiling = report["copy"]["tb_per_s_median"]
        print(f"copy ceiling {ceiling:.3f} TB/s")
        save()
    sets = [("", shapes, torch.bfloat16, not (args.no_sweep or args.smoke))]
    if not args.smoke:  # fp32 masters (28 B / param): embedding, head and layers 0-5, about half the model
        sets.append(("fp32 masters: ", [(n, s) for n, s in shapes if not n.startswith("layers.")
                                        or int(n.split(".")[1]) < 6], torch.float32, False))
    for prefix, part, dtype, sweep in sets:
        time_rows(report, prefix, part, dtype, device, ceiling, sweep and triton_ok, triton_ok, args, save)
        if cuda:
            torch.cuda.empty_cache()
    rows = {r["name"]: r for r in report["rows"]}
    base = rows.get("clip (foreach mul) + torch fused AdamW")  # the bf16 set: the dsv3-12l run's
    tri = [r for r in report["rows"] if r["name"].startswith("TritonAdamW clip")]
    if base and tri:
        best = min(tri, key=lambda r: r["median_ms"])
        report["summary"] = {"clip_plus_torch_fused_ms": base["median_ms"], "best_triton_ms": best["median_ms"],
                             "best_triton_kernel": best.get("kernel"),
                             "saved_ms": base["median_ms"] - best["median_ms"],
                             "best_triton_fraction_of_copy_ceiling": best["fraction_of_copy_ceiling"],
                             "checks_ok": all(c["ok"] for c in report["checks"]) and bool(report["checks"])}
        fp32 = [rows.get(f"fp32 masters: {k}") for k in ("clip (foreach mul) + torch fused AdamW",
                                                          "TritonAdamW clip + AdamW (default config)")]
        if all(fp32):
            report["summary"]["fp32_masters"] = {"params": fp32[0]["params"], "clip_plus_torch_fused_ms":
                                                 fp32[0]["median_ms"], "triton_ms": fp32[1]["median_ms"]}
        print("summary", report["summary"])
    print(f"\n{'row':92s} {'median ms':>10s} {'host ms':>8s} {'TB/s':>7s} {'of copy':>8s}")
    for r in report["rows"]:
        frac = f"{r['fraction_of_copy_ceiling']:.1%}" if r["fraction_of_copy_ceiling"] else "-"
        print(f"{r['name']:92s} {r['median_ms']:10.2f} {r['median_host_ms']:8.2f} {r['tb_per_s']:7.3f} {frac:>8s}")
    for c in report["checks"]:
        print(f"check {c['dtype']} clip={c['clip']}: ok={c['ok']} (steps {c['steps_ok']})")
        for key in ("param", "exp_avg", "exp_avg_sq"):
            k = c[key]
            print(f"  {key:10s} vs torch: max {k['max_abs_diff_vs_torch']:.3g} "
                  f"({k['fraction_differing_from_torch']:.2%} differ); rel error vs fp64: torch "
                  f"{k['rel_error_vs_fp64']['torch']:.3g}, triton {k['rel_error_vs_fp64']['triton']:.3g}")
    save()


if __name__ == "__main__":
    main()
