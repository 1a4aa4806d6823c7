"""Autograd formulas for the training and eval ops (torch.library.register_autograd).

Training: the batch statistics make y = BN(h * scale) depend on the whole
column, so the backward is batch_norm_backward (one reduction pass and one
elementwise pass, fused in CUDA) followed by dX = dH W and dW = dHᵀ x. The
linear bias gets exactly zero: y does not change when a column of h shifts.
Eval: the running statistics are constants, so the layer is a linear map.
"""
import torch

from .ops import ops


def _no_double_backward():
    # Backward runs with grad mode on only when create_graph=True was asked for.
    if torch.is_grad_enabled():
        raise RuntimeError("cutlass_fused: double backward (create_graph=True) is not supported")


def _cast(t, like):
    return None if t is None or like is None else t.to(like.dtype)


def _linear_grads(ctx, dh, x, weight):
    dx = dh @ weight if ctx.needs_input_grad[0] else None
    dw = dh.t() @ x if ctx.needs_input_grad[1] else None
    return dx, dw


def _setup_train(ctx, inputs, output):
    x, weight, bias, scale, bn_weight, bn_bias, eps, _, _ = inputs
    _, h, stats, mean, invstd = output
    ctx.save_for_backward(x, weight, h, mean, invstd, scale, bn_weight)
    ctx.eps = eps
    ctx.has = (bias is not None, bn_bias is not None)
    ctx.mark_non_differentiable(h, stats, mean, invstd)
    # Their gradients are always None; materializing them costs four fills a step.
    ctx.set_materialize_grads(False)


def _backward_train(ctx, dy, *_):
    _no_double_backward()
    if dy is None:  # grads are not materialized: y did not reach the loss
        return (None,) * 9
    x, weight, h, mean, invstd, scale, bn_weight = ctx.saved_tensors
    dh, dscale, dgamma, dbeta = ops.batch_norm_backward(dy, h, mean, invstd, scale, bn_weight, ctx.eps)
    dx, dw = _linear_grads(ctx, dh, x, weight)
    has_bias, has_bn_bias = ctx.has
    dbias = weight.new_zeros(weight.shape[0]) if has_bias and ctx.needs_input_grad[2] else None
    return (dx, dw, dbias, _cast(dscale, scale), _cast(dgamma, bn_weight),
            dbeta.to(dy.dtype if bn_weight is None else bn_weight.dtype) if has_bn_bias else None,
            None, None, None)


def _setup_eval(ctx, inputs, output):
    x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, eps, _ = inputs
    ctx.save_for_backward(x, weight, bias, scale, bn_weight, running_mean, running_var)
    ctx.eps = eps
    ctx.has_bn_bias = bn_bias is not None


def _backward_eval(ctx, dy):
    _no_double_backward()
    x, weight, bias, scale, bn_weight, running_mean, running_var = ctx.saved_tensors
    need = ctx.needs_input_grad
    invstd = (running_var.float() + ctx.eps).rsqrt()
    g = invstd if bn_weight is None else invstd * bn_weight.float()
    dyf = dy.float()
    dh = (dyf * (scale.float() * g)).to(dy.dtype)
    dx, dw = _linear_grads(ctx, dh, x, weight)
    dbias = dh.float().sum(0).to(bias.dtype) if bias is not None and need[2] else None
    dscale = dgamma = None
    if need[3] or need[4]:
        # h is not kept by the eval forward; recompute it only when asked for.
        h = (x @ weight.t()).float()
        if bias is not None:
            h = h + bias.float()
        if need[3]:
            dscale = ((dyf * h).sum(0) * g).to(scale.dtype)
        if need[4] and bn_weight is not None:
            dgamma = ((dyf * (h * scale.float() - running_mean.float())).sum(0) * invstd).to(bn_weight.dtype)
    dbeta = dyf.sum(0).to(dy.dtype) if ctx.has_bn_bias and need[5] else None
    return dx, dw, dbias, dscale, dgamma, dbeta, None, None, None, None


torch.library.register_autograd("cutlass_fused::linear_scale_batch_norm_train", _backward_train,
                                setup_context=_setup_train)
torch.library.register_autograd("cutlass_fused::linear_scale_batch_norm_eval", _backward_eval,
                                setup_context=_setup_eval)
