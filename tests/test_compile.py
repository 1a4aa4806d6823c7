"""The layer under torch.compile(fullgraph=True): forward, backward and the in-place
running-stat updates, with a dynamic batch."""
import pytest
import torch

import cutlass_fused
from common import FAMILIES, FAMILY_IDS, max_err


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_compiled_train_step_matches_eager(device, family):
    torch.manual_seed(0)
    eager = cutlass_fused.LinearScaleBatchNorm1d(24, 16, device=device)
    compiled_layer = cutlass_fused.LinearScaleBatchNorm1d(24, 16, device=device)
    compiled_layer.load_state_dict(eager.state_dict())

    # The forward graph is compiled whole (fakes, autograd formula, running-stat
    # mutation); backward runs the compiled backward graph. aot_eager needs no
    # C++ toolchain for code generation.
    compiled = torch.compile(compiled_layer, fullgraph=True, dynamic=True, backend="aot_eager")
    with cutlass_fused.use_kernel_family(family):
        for m in (8, 13, 8):
            x = torch.randn(m, 24, device=device)
            y_e, y_c = eager(x), compiled(x)
            y_e.square().mean().backward()
            y_c.square().mean().backward()
            assert max_err(y_c, y_e) < 1e-5
    for (k, a), b in zip(eager.state_dict().items(), compiled_layer.state_dict().values()):
        assert max_err(a, b) < 1e-5, k
    for (k, a), b in zip(eager.named_parameters(), compiled_layer.parameters()):
        assert max_err(a.grad, b.grad) < 1e-5, k
