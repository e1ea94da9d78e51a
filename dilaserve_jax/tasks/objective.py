"""The masked-diffusion training objective and the jitted optimiser step.

LLaDA SFT: the prompt is never masked; each answer-area token (EOS padding included) is masked
independently with probability p = (1 - eps) t + eps, t ~ U(0, 1) per row; the loss is the
cross-entropy on masked positions weighted by 1/p, summed per row, divided by the row's answer
area length and averaged over rows.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax

from dilaserve_jax.models.llada import canvas_positions, forward


def mask_batch(key, tokens, answer_mask, mask_id: int, eps: float):
    """(noisy tokens, masked positions, per-position mask probability)."""
    k_t, k_u = jax.random.split(key)
    t = jax.random.uniform(k_t, (tokens.shape[0], 1))
    p_mask = jnp.broadcast_to((1.0 - eps) * t + eps, tokens.shape)
    masked = answer_mask & (jax.random.uniform(k_u, tokens.shape) < p_mask)
    return jnp.where(masked, mask_id, tokens), masked, p_mask


def diffusion_loss(params, graphdef, key, tokens, answer_mask, valid_len, *, mask_id: int, eps: float):
    noisy, masked, p_mask = mask_batch(key, tokens, answer_mask, mask_id, eps)
    logits, _ = forward(graphdef, params, noisy, canvas_positions(*tokens.shape), valid_len=valid_len)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
    answer_len = jnp.maximum(answer_mask.sum(axis=1, keepdims=True), 1)
    per_token = jnp.where(masked, ce / p_mask, 0.0) / answer_len
    return per_token.sum() / tokens.shape[0]


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float, clip: float,
                   final_lr_ratio: float = 0.1) -> optax.GradientTransformation:
    """AdamW with linear warm-up, cosine decay to final_lr_ratio * lr, global-norm clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=max(1, min(warmup, steps - 1)),
        decay_steps=max(steps, 2), end_value=lr * final_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=weight_decay))


def make_train_step(graphdef, optimizer: optax.GradientTransformation, *, mask_id: int, eps: float):
    """jit(step)(params, opt_state, key, tokens, answer_mask, valid_len) -> (params, opt_state, loss).

    params and opt_state are donated: the step updates them in place.
    """
    loss_fn = partial(diffusion_loss, graphdef=graphdef, mask_id=mask_id, eps=eps)

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, key, tokens, answer_mask, valid_len):
        loss, grads = jax.value_and_grad(loss_fn)(params, key=key, tokens=tokens,
                                                  answer_mask=answer_mask, valid_len=valid_len)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step
