"""The FP8 rows both benchmarks build from a row's name: our Float8Recipe, and torchao's float8
training as issue 33's anchor (torchao is not a dependency)."""
import dataclasses

from torch import nn

import cutlass_fused


def fp8_recipe(row):
    """The Float8Recipe a row's name asks for (the layer's "cutlass_fused-fp8[-delayed][-e5m2][-fast]",
    the step's "fused-fp8[-delayed][-e5m2][-fast][+compile]")."""
    return cutlass_fused.Float8Recipe(backward="e5m2" if "e5m2" in row else "bf16",
                                      scaling="delayed" if "delayed" in row else "current",
                                      fast_accum="-fast" in row)


def torchao_float8(model, recipe, device):
    """model with its Linears in torchao's float8 training (issue 33's anchor; recipe: tensorwise or
    rowwise; emulated off CUDA), those whose sizes are multiples of 16, as torch._scaled_mm needs:
    the step benchmark's 1000-way head stays as it is. Raises where none is."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:
        raise RuntimeError("the torchao rows need torchao (pip install torchao)") from e
    config = Float8LinearConfig.from_recipe_name(recipe)
    if device.type != "cuda":
        config = dataclasses.replace(config, emulate=True)

    def eligible(module, fqn):
        return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
    model = convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    if not any(isinstance(m, Float8Linear) for m in model.modules()):
        raise RuntimeError("torchao's float8 training needs Linear sizes that are multiples of 16; none is here")
    return model
