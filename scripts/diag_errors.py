import subprocess, sys
cases = {
 "cpu_stats_badshape": "ops.linear_scale_stats(torch.randn(4,7), torch.randn(5,6), None, torch.randn(5), 'auto', False)",
 "cpu_eval_badshape": "ops.linear_scale_batch_norm_eval(torch.randn(4,7), torch.randn(5,6), None, torch.randn(5), None, None, torch.zeros(5), torch.ones(5), 1e-5, 'auto')",
 "cpu_finalize_badcount": "ops.batch_norm_finalize(torch.randn(4,5), torch.randn(2,5).double(), 1, None, None, None, None, None, 0.1, 1e-5)",
 "cuda_stats_badshape": "ops.linear_scale_stats(torch.randn(4,7,device='cuda'), torch.randn(5,6,device='cuda'), None, torch.randn(5,device='cuda'), 'auto', False)",
 "cuda_finalize_badcount": "ops.batch_norm_finalize(torch.randn(4,5,device='cuda'), torch.randn(2,5,device='cuda').double(), 1, None, None, None, None, None, 0.1, 1e-5)",
 "torch_own_error": "torch.ops.aten.mm(torch.randn(4,7), torch.randn(5,6))",
}
for name, stmt in cases.items():
    code = f"import torch, cutlass_fused\nfrom cutlass_fused.ops import ops\ntry:\n    {stmt}\nexcept Exception as e:\n    print(type(e).__name__, str(e)[:120])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(f"{name}: rc={r.returncode} {r.stdout.strip()[:200]} {r.stderr.strip()[-300:] if r.returncode else ''}")
