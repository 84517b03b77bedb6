"""torch.compile of ring_attention on CUDA where auto picks the efficient kernels: the pass traces
them, and the compiled fwd+bwd matches eager and float64."""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dtensor_ring as dr
from dtensor_ring import passes
from dtensor_ring.kernels import get_kernel
from dtensor_ring.numerics import fwd_bwd, rel_rms, sdpa

dist.init_process_group("nccl", init_method="file:///tmp/compile_check_store", rank=0, world_size=1)
mesh = init_device_mesh("cuda", (1,))
for dtype, head_dim, precision in ((torch.float32, 128, "fp32"), (torch.bfloat16, 256, "exact")):
    name = get_kernel("auto", torch.device("cuda"), dtype, head_dim, precision).name
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1, 4, 512, head_dim), (1, 2, 512, head_dim), (1, 2, 512, head_dim), (1, 4, 512, head_dim)]
    q, k, v, dout = (torch.randn(s, generator=gen, device="cuda").to(dtype) for s in shapes)

    def attend(a, b, c):
        return dr.ring_attention(a, b, c, mesh=mesh, schedule="zigzag", is_causal=True,
                                 precision=precision)

    reference = fwd_bwd(sdpa(True), *(x.double() for x in (q, k, v, dout)))
    eager = fwd_bwd(attend, q, k, v, dout)
    before = dict(passes.COUNTERS)
    compiled = fwd_bwd(torch.compile(attend, fullgraph=True), q, k, v, dout)
    expanded = {key: passes.COUNTERS[key] - before.get(key, 0) for key in passes.COUNTERS}
    print(f"{str(dtype):15} d={head_dim} {precision:5} kernel={name} expanded={expanded}")
    for n, e, c, r in zip(("out", "dq", "dk", "dv"), eager, compiled, reference):
        print(f"   {n}: eager {rel_rms(e, r):.3e}  compiled {rel_rms(c, r):.3e}  "
              f"compiled vs eager max |diff| {(c.double() - e.double()).abs().max().item():.3e}")
dist.destroy_process_group()
