"""model.fp8 (issue 38 item 2): hostile recipe / backend / modules values, dims the 128-wide tiles do not divide, a
compute dtype FP8 cannot sit in, a GPU backend (deep_gemm included) on a CPU machine, weight_cache, wgrad and
bf16-layer values (and weight_cache 'on' with train.compile), FP8 dispatch on layouts that cannot send it (one EP
rank; the copy engines and DeepEP on a CPU machine; and a rehearsed EP-2 rank that sends it), the FP8 parameter
all-gather (param_gather) where it cannot run and on two ranks, and FP8 beside the other precision and optimizer
options (`spartron train` and `spartron plan`)."""

from __future__ import annotations

from benchmarks.auditing.core import Case, plan, sets, train

SHAPE = ('model.dtype="bfloat16"', "model.dim=128", "model.moe.moe_inter_dim=128", "model.dense_inter_dim=256")
FP8 = (*SHAPE, 'model.fp8.backend="reference"')


def cases() -> list[Case]:
    out: list[Case] = []

    def add(cid, argv, names, category="values", **kw):
        out.append(Case(f"fp8-{cid}", "config", argv, tuple(names), category=category,
                        timeout=kw.pop("timeout", 120.0), **kw))

    add("recipe-unknown", train(*FP8, 'model.fp8.recipe="tensorwise"'), ("model.fp8.recipe",), quick=True)
    add("backend-unknown", train(*SHAPE, 'model.fp8.backend="deepgemm"'), ("model.fp8.backend",))
    add("backend-int", train(*SHAPE, "model.fp8.backend=1"), ("model.fp8.backend",), category="dtypes")
    add("modules-empty", train(*FP8, "model.fp8.modules=[]"), ("model.fp8.modules",))
    add("modules-unknown", train(*FP8, 'model.fp8.modules=["attention"]'), ("model.fp8.modules",))
    add("modules-duplicate", train(*FP8, 'model.fp8.modules=["dense","dense"]'), ("model.fp8.modules",))
    add("modules-string", train(*FP8, 'model.fp8.modules="experts"'), ("model.fp8.modules",), category="dtypes")
    add("pow2-string", train(*FP8, 'model.fp8.power_of_two_scales="yes"'), ("model.fp8.power_of_two_scales",),
        category="dtypes")
    add("unknown-key", train(*FP8, 'model.fp8.scale="e8m0"'), ("model.fp8.scale",))
    add("section-not-table", train(*SHAPE, "model.fp8=1"), ("model.fp8",), category="dtypes")
    add("float32-dtype", train("model.dim=128", "model.moe.moe_inter_dim=128", 'model.fp8.backend="reference"'),
        ("model.fp8", "model.dtype"))
    add("dim-not-128", train('model.dtype="bfloat16"', "model.moe.moe_inter_dim=128", 'model.fp8.backend="reference"'),
        ("model.dim",), category="sizes")
    add("inter-not-128", train('model.dtype="bfloat16"', "model.dim=128", 'model.fp8.backend="reference"'),
        ("model.moe.moe_inter_dim",), category="sizes")
    add("dense-none-eligible", train('model.dtype="bfloat16"', 'model.fp8.backend="reference"',
                                     'model.fp8.modules=["dense"]'), ("model.fp8.modules",), category="sizes")
    add("gpu-backend-on-cpu", train(*SHAPE, 'model.fp8.backend="triton"'), ("model.fp8.backend",))
    add("scaled-mm-on-cpu", train(*SHAPE, 'model.fp8.backend="torch_scaled_mm"'), ("model.fp8.backend",))
    add("deep-gemm-on-cpu", train(*SHAPE, 'model.fp8.backend="deep_gemm"'), ("model.fp8.backend",))
    add("deep-gemm-plan", plan(*SHAPE, 'model.fp8.backend="deep_gemm"'), (), accept_ok=True)
    add("wgrad-unknown", train(*FP8, 'model.fp8.wgrad="bf16"'), ("model.fp8.wgrad",))
    add("wgrad-bool", train(*FP8, "model.fp8.wgrad=false"), ("model.fp8.wgrad",), category="dtypes")
    add("step-wgrad-model-dtype", train(*FP8, 'model.fp8.wgrad="model_dtype"'), (), accept_ok=True, timeout=240.0)
    add("bf16-layers-all", train(*FP8, "model.fp8.layers_at_start_in_bf16=2", "model.fp8.layers_at_end_in_bf16=2"),
        ("model.fp8.layers_at_start_in_bf16",), category="sizes")
    add("bf16-layers-negative", train(*FP8, "model.fp8.layers_at_end_in_bf16=-1"),
        ("model.fp8.layers_at_end_in_bf16",), category="sizes")
    add("bf16-layers-float", train(*FP8, "model.fp8.layers_at_start_in_bf16=1.5"),
        ("model.fp8.layers_at_start_in_bf16",), category="dtypes")
    add("bf16-layers-huge", train(*FP8, "model.fp8.layers_at_start_in_bf16=99999999999999999999"),
        ("model.fp8.layers_at_start_in_bf16",), category="sizes")
    add("bf16-layers-experts-only-dense", train(*FP8, 'model.fp8.modules=["experts"]', "model.mtp.depth=0",
                                                "model.fp8.layers_at_end_in_bf16=3"),
        ("model.fp8.modules", "model.fp8.layers_at_end_in_bf16"))
    add("step-bf16-layers", train(*FP8, "model.fp8.layers_at_start_in_bf16=1", "model.fp8.layers_at_end_in_bf16=1"),
        (), accept_ok=True, timeout=240.0)
    add("weight-cache-unknown", train(*FP8, 'model.fp8.weight_cache="always"'), ("model.fp8.weight_cache",))
    add("weight-cache-bool", train(*FP8, "model.fp8.weight_cache=true"), ("model.fp8.weight_cache",),
        category="dtypes")
    add("weight-cache-on-compiled", train(*FP8, 'model.fp8.weight_cache="on"', "train.compile=true"),
        ("model.fp8.weight_cache", "train.compile"))
    add("dispatch-one-ep-rank", train(*FP8, "model.fp8.dispatch=true"), ("model.fp8.dispatch", "parallel.ep"))
    add("dispatch-string", train(*FP8, 'model.fp8.dispatch="yes"'), ("model.fp8.dispatch",), category="dtypes")
    # FP8 rows over the copy engines and DeepEP: accepted by the config; on a CPU machine both transports refuse
    add("dispatch-copy-engine", train(*FP8, "model.fp8.dispatch=true", "parallel.ep=2", "launch.nproc=2",
                                      'model.moe.all_to_all_transport="copy_engine"'), ("all_to_all_transport",))
    add("dispatch-deepep", train(*FP8, "model.fp8.dispatch=true", "parallel.ep=2", "launch.nproc=2",
                                 'model.moe.dispatcher="deepep"'), ("model.moe.dispatcher",))
    add("dispatch-not-pow2", train(*FP8, "model.fp8.dispatch=true", "model.fp8.power_of_two_scales=false"),
        ("model.fp8.dispatch", "model.fp8.power_of_two_scales"))
    add("dispatch-dense-only", train(*FP8, "model.fp8.dispatch=true", 'model.fp8.modules=["dense"]'),
        ("model.fp8.dispatch", "model.fp8.modules"))
    out.append(Case("fp8-dispatch-rehearse-ep2", "config",
                    ["rehearse", "{tiny}", "--world-size", "4", "--steps", "1",
                     *sets(*FP8, "model.fp8.dispatch=true", "parallel.ep=2", "train.global_batch_size=4",
                           "train.peak_tflops=1.0")],
                    (), category="values", timeout=240.0, accept_ok=True))
    gather = ("model.fp8.param_gather",)
    add("param-gather-string", train(*FP8, 'model.fp8.param_gather="yes"'), gather, category="dtypes")
    add("param-gather-one-rank", train(*FP8, "model.fp8.param_gather=true"), gather)
    add("param-gather-compiled", train(*FP8, "model.fp8.param_gather=true", "launch.nproc=2", "train.compile=true"),
        (*gather, "train.compile"))
    add("param-gather-weight-cache-on", train(*FP8, "model.fp8.param_gather=true", 'model.fp8.weight_cache="on"'),
        (*gather, "model.fp8.weight_cache"))
    add("param-gather-plan", plan(*FP8, "model.fp8.param_gather=true"), (), accept_ok=True)
    add("step-param-gather-two-ranks", train(*FP8, "model.fp8.param_gather=true", "launch.nproc=2",
                                             'model.master_dtype="float32"'), (), accept_ok=True, timeout=300.0)
    out.append(Case("fp8-param-gather-rehearse-ep2", "config",
                    ["rehearse", "{tiny}", "--world-size", "4", "--steps", "1",
                     *sets(*FP8, "model.fp8.param_gather=true", "model.fp8.dispatch=true", "parallel.ep=2",
                           "train.global_batch_size=4", "train.peak_tflops=1.0")],
                    (), category="values", timeout=240.0, accept_ok=True))
    add("plan", plan(*FP8), (), accept_ok=True)
    add("plan-weight-cache-on", plan(*FP8, 'model.fp8.weight_cache="on"'), (), accept_ok=True)
    add("step-weight-cache-on", train(*FP8, 'model.fp8.weight_cache="on"'), (), accept_ok=True, timeout=240.0)
    add("step", train(*FP8), (), accept_ok=True, timeout=240.0)
    add("step-master-weights", train(*FP8, 'model.master_dtype="float32"', 'model.master_weights="optimizer"'), (),
        accept_ok=True, timeout=240.0)
    add("step-muon", train(*FP8, 'train.optimizer="muon"'), (), accept_ok=True, timeout=240.0)
    return out
