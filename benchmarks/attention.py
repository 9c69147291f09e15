"""Dense MLA attention at the benchmark shape: which SDPA layouts run fast, isolated and inside the layer.

    python benchmarks/attention.py --commit $(git rev-parse HEAD) --out benchmarks/results/attention/attention.json

Shapes default to dsv3-12l's attention (B 2, H 16, S 4096, qk 192, v 128, causal, bf16). Variants:
- `bhsd_contiguous`: q, k, v each contiguous [B, H, S, D] (the layout SDPA documents);
- `layer_views`: the MLA layer's layout: q, k contiguous [B, S, H, 192] transposed, v a strided slice
  of wkv_b's [B, S, H, 256] output, grad_out laid out like the output;
- `layer_views_grad_bhsd`: the same with a contiguous [B, H, S, 128] grad_out;
- `mla_layer`: the `MLA` module forward + backward itself (what the step runs), attention kernels only.
For each: forward and forward+backward ms (CUDA events, median over --iters), effective TFLOP/s
(causal: half the S x S products, backward 2.5x forward), and the attention kernels the profiler saw.
The gate-weighted top-k sum of MoE finalize is timed too (every GEMM kernel name listed, so a
misaligned `align2` kernel shows).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import call_times_ms, device_name, write_report  # noqa: E402

from spartron.layers.attention.mla import MLA  # noqa: E402
from spartron.layers.moe.dispatch import gate_weighted_sum  # noqa: E402
from spartron.runtime.config import load_config  # noqa: E402


def _events_ms(fn, iters: int) -> list[float]:
    return call_times_ms(fn, iters, torch.device("cuda"))


def _kernels(fn, pattern: tuple[str, ...]) -> dict[str, float]:
    """Mean µs per call of every kernel whose lower-cased name contains one of `pattern`."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and any(p in e.key.lower() for p in pattern):
            out[e.key[:140]] = round(e.device_time_total / 3, 1)
    return out


def attention_variants(b: int, h: int, s: int, nope: int, rope: int, vd: int, scale: float, iters: int) -> list[dict]:
    dev, dt = torch.device("cuda"), torch.bfloat16
    qk = nope + rope
    flops_fwd = 2 * b * h * s * s * (qk + vd) / 2
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g)

    def layer_layout():
        q = rnd(b, s, h, qk).transpose(1, 2)
        k = rnd(b, s, h, qk).transpose(1, 2)
        v = rnd(b, s, h, nope + vd)[..., nope:].transpose(1, 2)
        return q, k, v

    def contiguous():
        return rnd(b, h, s, qk), rnd(b, h, s, qk), rnd(b, h, s, vd)

    rows = []
    for name, make, grad_bhsd in (("bhsd_contiguous", contiguous, True), ("layer_views", layer_layout, False),
                                  ("layer_views_grad_bhsd", layer_layout, True)):
        q, k, v = (t.requires_grad_() for t in make())
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        grad = rnd(b, h, s, vd) if grad_bhsd else torch.randn_like(out)

        def fwd(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

        def fwd_bwd(q=q, k=k, v=v, grad=grad, fwd=fwd):
            torch.autograd.grad(fwd(), (q, k, v), grad)

        rows.append(_row(name, fwd, fwd_bwd, iters, flops_fwd, {
            "q_stride": list(q.stride()), "k_stride": list(k.stride()), "v_stride": list(v.stride()),
            "out_stride": list(out.stride()), "grad_stride": list(grad.stride())}))
    return rows


def mla_layer_row(cfg_path: Path, iters: int) -> dict:
    cfg = load_config(cfg_path, []).model
    layer = MLA(cfg, 0).to(device="cuda", dtype=torch.bfloat16)
    b, s = 2, cfg.max_seq_len
    x = torch.randn(b, s, cfg.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(s, device="cuda")
    grad = torch.randn(b, s, cfg.dim, device="cuda", dtype=torch.bfloat16)

    def fwd():
        return layer(x, pos)["hidden_states"]

    def fwd_bwd():
        fwd().backward(grad)

    qk = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
    flops = 2 * b * cfg.n_heads * s * s * (qk + cfg.mla.v_head_dim) / 2
    row = _row("mla_layer (whole layer time; attention kernels below)", fwd, fwd_bwd, iters, flops, {})
    return row


def _row(name, fwd, fwd_bwd, iters, flops_fwd, extra) -> dict:
    for _ in range(3):
        fwd_bwd()
    f = _events_ms(fwd, iters)
    fb = _events_ms(fwd_bwd, iters)
    fm, fbm = statistics.median(f), statistics.median(fb)
    return {"variant": name, **extra, "fwd_ms": fm, "fwd_bwd_ms": fbm, "fwd_ms_all": f, "fwd_bwd_ms_all": fb,
            "fwd_tflops": flops_fwd / fm / 1e9, "fwd_bwd_tflops": 3.5 * flops_fwd / fbm / 1e9,
            "kernels_us": _kernels(fwd_bwd, ("sdpa", "flash", "fmha", "attention", "cudnn"))}


def gate_sum_rows(tokens: int, top_k: int, dim: int, iters: int) -> list[dict]:
    dev, dt = torch.device("cuda"), torch.bfloat16
    y = torch.randn(tokens, top_k, dim, device=dev, dtype=dt, requires_grad=True)
    w = torch.rand(tokens, top_k, device=dev, dtype=dt, requires_grad=True)
    grad = torch.randn(tokens, dim, device=dev, dtype=dt)
    rows = []
    for name, fn in (("bmm_autograd", lambda: torch.bmm(w.unsqueeze(1), y).squeeze(1)),
                     ("gate_weighted_sum", lambda: gate_weighted_sum(w, y))):
        def fwd_bwd(fn=fn):
            torch.autograd.grad(fn(), (y, w), grad)
        for _ in range(3):
            fwd_bwd()
        t = _events_ms(fwd_bwd, iters)
        rows.append({"variant": name, "fwd_bwd_ms": statistics.median(t), "fwd_bwd_ms_all": t,
                     "kernels_us": _kernels(fwd_bwd, GEMM_NAMES)})
    yd, gd = y.detach(), grad
    for name, fn in (("grad_w_bmm_nt (autograd's)", lambda: torch.bmm(gd.unsqueeze(1), yd.transpose(1, 2))),
                     ("grad_w_bmm_col (gate_weighted_sum's)", lambda: torch.bmm(yd, gd.unsqueeze(-1))),
                     ("grad_w_vecdot", lambda: torch.linalg.vecdot(yd, gd.unsqueeze(1)))):
        for _ in range(3):
            fn()
        t = _events_ms(fn, iters)
        rows.append({"variant": name, "fwd_bwd_ms": statistics.median(t), "fwd_bwd_ms_all": t,
                     "kernels_us": _kernels(fn, GEMM_NAMES)})
    return rows


GEMM_NAMES = ("gemm", "gemv", "cutlass", "nvjet", "sm80", "sm90", "wmma", "elementwise", "reduce", "dot")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=REPO / "configs" / "dsv3-12l.toml")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--commit", required=True, help="the commit measured (the device copy's git lies)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    cfg = load_config(args.config, []).model
    from spartron.layers.attention.rope import mla_softmax_scale

    mla = cfg.mla
    rows = attention_variants(2, cfg.n_heads, cfg.max_seq_len, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
                              mla.v_head_dim, mla_softmax_scale(mla), args.iters)
    rows.append(mla_layer_row(args.config, args.iters))
    gate = gate_sum_rows(2 * cfg.max_seq_len, cfg.moe.top_k, cfg.dim, args.iters)
    for r in rows + gate:
        print(f"{r['variant']:<58} fwd {r.get('fwd_ms', float('nan')):7.3f} ms  fwd+bwd {r['fwd_bwd_ms']:7.3f} ms"
              f"  {r.get('fwd_bwd_tflops', float('nan')):6.0f} TFLOP/s")
        for k, us in sorted(r["kernels_us"].items(), key=lambda kv: -kv[1])[:6]:
            print(f"    {us:9.1f} us  {k}")
    import triton

    write_report(args.out, {"benchmark": "attention", "device": device_name(True), "torch": torch.__version__,
                            "triton": triton.__version__, "cudnn": torch.backends.cudnn.version(),
                            "commit": args.commit, "config": str(args.config.relative_to(REPO)),
                            "iters": args.iters, "attention": rows, "gate_weighted_sum": gate})


if __name__ == "__main__":
    main()
