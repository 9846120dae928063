#!/usr/bin/env bash
# What the GPU figures in benchmarks/results/ were produced with, one step per argument, in order:
#   bash benchmarks/gpu_session.sh setup gputests tune suite
#   bash benchmarks/gpu_session.sh setup routes normsbench models gputests   (issue 27: per-shape routes)
#   bash benchmarks/gpu_session.sh setup launch gputests models routes       (issue 27: direct launches)
# setup installs normswap (editable, no dependencies: the machine has them) and any wheels in .whl/
# (Liger-Kernel); every other step writes its log and results under $OUT (default ./gpu_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=python3

# The route rules the bench steps run with: ROUTES_RULES, else a routes step's output, else built-in.
rules_env() {
  local rules=${ROUTES_RULES:-$OUT/routes.json}
  if [ -f "$rules" ]; then export NORMSWAP_ROUTE_RULES=$rules; else unset NORMSWAP_ROUTE_RULES; fi
  echo "route rules: ${NORMSWAP_ROUTE_RULES:-built-in}"
}

for step in "$@"; do
  echo "=== $step $(date +%T)"
  case "$step" in
    setup)
      if ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site
      fi
      $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
      $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
      $PY -c "import liger_kernel, transformers, timm; print('liger ok; transformers', transformers.__version__, 'timm', timm.__version__)"
      # Which route the ops took: triton_op (torch.compile sees the kernels) or the custom-op fallback.
      $PY -c "import torch; from torch._library.triton import triton_ops_to_kernels as t; import normswap.kernels; n = sorted(k for k in t if k.startswith('normswap')); print(len(n), 'normswap ops are triton_ops' if n else 'normswap ops are custom ops (opaque to Inductor)')"
      ;;
    gputests)
      timeout "${GPUTESTS_TIMEOUT:-300}" $PY -m pytest -q -m gpu -n "${GPU_WORKERS:-1}" -p no:cacheprovider -rfE --tb=short \
        ${GPUTESTS_ARGS:-} tests 2>&1 | tee "$OUT/gputests.log" | tail -40
      ;;
    routes)
      # Where each route of an eager call wins, per shape; the rules the later steps apply (their
      # NORMSWAP_ROUTE_RULES) unless ROUTES_RULES names others.
      timeout "${ROUTES_TIMEOUT:-300}" $PY benchmarks/tune_routes.py --out "$OUT/routes.json" ${ROUTES_ARGS:-} 2>&1 | tail -40
      ;;
    launch)
      # Host time per eager call: Triton's launch against the direct launch, modules against theirs.
      timeout "${LAUNCH_TIMEOUT:-90}" $PY benchmarks/bench_launch_gpu.py --out "$OUT/launch.json" 2>&1 | tail -45
      ;;
    normsbench)
      # bench_norms with the routes just tuned (if a routes step ran): normswap against eager on every shape.
      rules_env
      timeout "${BENCH_TIMEOUT:-560}" $PY benchmarks/bench_norms.py \
        --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v "^\(rms\|layer\) " | tail -40
      ;;
    models)
      rules_env
      timeout "${MODELS_TIMEOUT:-300}" $PY benchmarks/bench_models_fused.py \
        --out "$OUT/models.json" ${MODELS_ARGS:-} 2>&1 | grep -v -i "warn\|output = func\|return forward_call" | tail -40
      ;;
    suite)
      # One thread per worker: 14 workers of 16 threads each oversubscribe the cores many times over.
      OMP_NUM_THREADS=1 timeout "${SUITE_TIMEOUT:-300}" $PY -m pytest -v -n 14 -p no:cacheprovider -rfE --tb=short \
        --durations=15 tests >"$OUT/suite.log" 2>&1
      echo "suite rc $?"
      grep -E "^(FAILED|ERROR)| (FAILED|ERROR) " "$OUT/suite.log" | cut -c1-300 | head -80
      tail -3 "$OUT/suite.log"
      ;;
    tune)
      timeout "${TUNE_TIMEOUT:-300}" $PY benchmarks/tune_norms.py --out "$OUT/tune_norms.jsonl" ${TUNE_ARGS:-} 2>&1 | tail -25
      ;;
    bench)
      timeout "${BENCH_TIMEOUT:-560}" $PY benchmarks/bench_norms.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
      ;;
    llama)
      timeout "${LLAMA_TIMEOUT:-300}" $PY benchmarks/bench_llama_fused.py --out "$OUT" ${LLAMA_ARGS:-} 2>&1 | tail -30
      ;;
    failing)
      # Tests that failed in an earlier run, with their tracebacks.
      timeout "${FAILING_TIMEOUT:-120}" $PY -m pytest -q -n 4 -p no:cacheprovider --tb=short ${FAILING_TESTS:-} \
        >"$OUT/failing.log" 2>&1
      grep -E "^E |^FAILED|passed|failed" "$OUT/failing.log" | cut -c1-240 | head -40
      ;;
    diag)
      # The backward through autograd against the launcher alone, and where the time goes.
      timeout 60 $PY - <<'PYEOF' 2>&1 | tail -40
import torch
from triton.testing import do_bench
from normswap.kernels import rms_norm
from normswap.kernels._launch import norm_bwd, norm_fwd
m, n = 16384, 8192
x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
y = rms_norm(x, w, None, 1e-6)
_, _, _, rstd = norm_fwd("rms", x.detach(), None, w.detach(), None, 1e-6, "none", 0.0)
direct = lambda: norm_bwd("rms", dy, None, x.detach(), w.detach(), None, None, rstd, "none", 0.0)
through = lambda: torch.autograd.grad((y,), (x, w), (dy,), retain_graph=True)
for name, fn in (("launcher", direct), ("autograd", through)):
    fn()
    print(name, f"{do_bench(fn, rep=200, return_mode='median') * 1e3:.0f} us")
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    for _ in range(5):
        through()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
PYEOF
      ;;
    bwdhost)
      # Where the host time of an eager backward goes at one row: autograd's device thread, or our code.
      timeout "${BWDHOST_TIMEOUT:-120}" $PY - <<'PYEOF' 2>&1 | tail -110
import cProfile, pstats, statistics, time
import torch
import torch.nn.functional as F
from normswap.kernels import kernel_route, rms_norm
from normswap.kernels._launch import launch_bwd, launch_fwd
n = 4096
x = torch.randn(1, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)
    @staticmethod
    def backward(ctx, g):
        return g
def us(fn, calls=500):
    for _ in range(50):
        fn()
    out = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(out)
_, _, _, rstd = launch_fwd("rms", x.detach(), None, w.detach(), None, 1e-6, "none", 0.0)
xd, wd = x.detach(), w.detach()
cases = {
    "F.rms_norm fwd+bwd": lambda: F.rms_norm(x, (n,), w, 1e-6).backward(dy),
    "normswap fwd+bwd": lambda: rms_norm(x, w, None, 1e-6).backward(dy),
    "normswap fwd (recording)": lambda: rms_norm(x, w, None, 1e-6),
    "launch_bwd alone": lambda: launch_bwd("rms", dy, None, xd, wd, None, None, rstd, "none", 0.0),
    "identity Function fwd+bwd": lambda: Identity.apply(x).backward(dy),
    "x*1 fwd+bwd (C++ nodes)": lambda: (x * 1).backward(dy),
}
with kernel_route("triton"):
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        for name, fn in cases.items():
            print(f"multithreading {threads!s:5} {name:28} {us(fn):8.1f} us")
    torch.autograd.set_multithreading_enabled(False)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(500):
        rms_norm(x, w, None, 1e-6).backward(dy)
    pr.disable()
    # Which kernels were launched straight through their compiled launcher, and which went through
    # Triton's own binding every time (a specialization the direct launcher declined to replay)
    from normswap.kernels._direct import _DIRECT
    for kernel in _DIRECT.values():
        name = getattr(kernel.kernel, "__name__", repr(kernel.kernel))
        print(f"{name:32} launches {kernel.launches:7} direct {kernel.direct_launches:7}")
    # A host-device synchronization inside the backward would serialize every call with the GPU
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(50):
            rms_norm(x, w, None, 1e-6).backward(dy)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
pstats.Stats(pr).sort_stats("tottime").print_stats(16)
PYEOF
      ;;
    bwddiag)
      # The backward's parts timed where autograd runs them and alone, with profiler traces to read offline.
      timeout "${BWDDIAG_TIMEOUT:-150}" $PY benchmarks/diag_backward_host_gpu.py --out "$OUT" 2>&1 | tee "$OUT/bwddiag.log" | tail -80
      ;;
    modeldiag)
      # A converted GPT-2 against its original: per-norm host time, operator counts, cProfile.
      timeout "${MODELDIAG_TIMEOUT:-150}" $PY benchmarks/diag_model_host_gpu.py --out "$OUT" 2>&1 \
        | grep -v -i "warn\|output = func\|return forward_call" | tee "$OUT/modeldiag.log" | tail -80
      ;;
    hostprof)
      # Host time of one eager call at one row, per route, and where the kernel route's time goes.
      timeout 90 $PY - <<'PYEOF' 2>&1 | tail -45
import cProfile, pstats, time
import torch
import torch.nn.functional as F
from normswap.kernels import kernel_route, rms_norm
x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
def us(fn, calls=3000):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6
with torch.no_grad():
    print(f"F.rms_norm {us(lambda: F.rms_norm(x, (4096,), w, 1e-6)):.1f} us/call")
    for route in ("torch", "triton"):
        with kernel_route(route):
            print(f"normswap rms_norm, route {route}: {us(lambda: rms_norm(x, w, None, 1e-6)):.1f} us/call")
    with kernel_route("triton"):
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(3000):
            rms_norm(x, w, None, 1e-6)
        pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(22)
PYEOF
      ;;
    *)
      echo "unknown step $step"
      exit 2
      ;;
  esac
done
