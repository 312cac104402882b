"""Probe (2026-12-02, Intel Xeon with AMX, 2 cores; not a library feature): SmolLM2-135M's linear layers (all 211, LM head included) for M rows,
torch's F.linear vs the library's AVX-512 small-batch kernel vs an AMX kernel that emulates fp32 with bf16
pieces (x split into 3 bf16 pieces stacked as rows, the weight into 2, products summed in fp32 with the
hi*hi term kept apart: fp32-class error, measured against float64 below). Needs a CPU with AMX-BF16 and gcc
with -mamx-tile. Run from this folder: `python linear_times.py`."""
import os, tempfile, time, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch.utils.cpp_extension import load
from pack import pack
torch.set_num_threads(2)
here = os.path.dirname(os.path.abspath(__file__))
build = tempfile.mkdtemp(prefix="amx_probe_")
ext = load(name="amx_probe", sources=[os.path.join(here, "amx_linear.cpp")],
           extra_cflags=["-O3", "-fopenmp", "-mavx512f", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
           extra_ldflags=["-fopenmp"], build_directory=build, verbose=False)
ext.amx_available()
from hf_adaptive_spec import models
from hf_adaptive_spec.ops import cpu_linear
m, tok = models.load("smollm2-135m-instruct")
lins = [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)]
W = [l.weight.detach() for l in lins]
print(len(W))
worst = 0
for w in W[:7]+W[-1:]:
    hi = w.bfloat16().float(); mid=(w-hi).bfloat16().float(); lo = w-hi-mid
    ratio = (lo.abs().sum(1)/w.abs().sum(1)).max().item()
    x = torch.randn(8, w.shape[1])
    ref = x.double() @ w.double().T
    y = ext.amx_linear(x, pack(w), w.shape[0]); f = x @ w.T
    print(tuple(w.shape), f"lo ratio {ratio:.2e}  amx err {(y.double()-ref).abs().max():.2e}  fp32 err {(f.double()-ref).abs().max():.2e}")
P = [pack(w) for w in W]
skern = cpu_linear._extension()
def run(Mr, fn):
    xs = {k: torch.randn(Mr,k) for k in (576,1536)}
    best=1e9
    for rep in range(5):
        t=time.perf_counter()
        for w,p in zip(W,P): fn(xs[w.shape[1]], w, p)
        best=min(best,time.perf_counter()-t)
    return best*1e3
for Mr in [1,2,4,8,16,24,32,48,64]:
    a = run(Mr, lambda x,w,p: torch.nn.functional.linear(x,w))
    b = run(Mr, lambda x,w,p: skern.small_linear(x,w)) if 1<Mr<=32 else float('nan')
    c = run(Mr, lambda x,w,p: ext.amx_linear(x,p,w.shape[0]))
    print(f"M={Mr:3d} torch {a:6.1f}  avx512 {b:6.1f}  amx {c:6.1f} ms")
