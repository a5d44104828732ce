"""Matrix products whose summation order the program fixes, not the CPU's matmul library.

XLA:CPU hands a ``dot`` to a library kernel (Eigen's tensor contraction) that chooses how
to cut the contraction at run time: by the size of the process's thread pool (with 4 or
more simulated devices it splits the 256 rows of a ``(256, 96)ᵀ(256, 96)`` product over
threads and adds the pieces, with 1-3 it does not), by the CPU's cache sizes, and by the
output's width (a column block of a ``model`` axis takes other paths than the whole
matrix). The same program then rounds differently on another split of a job or another
machine. :func:`fixed_order` evaluates a function with every floating-point ``dot_general``
replaced by elementwise products added one contraction index after another, in index
order: each output element is ``((p_0 + p_1) + p_2) + ...`` whatever the shapes, threads
or caches. It costs speed (no blocked kernel), so the engine uses it only where it
promises bitwise results (``logical_shards`` on CPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Literal
from jax.extend.core import primitives as prims

# Contraction indices a loop iteration adds (one pass over the output), and the most
# product elements a chunk may hold.
CHUNK, CHUNK_ELEMENTS = 2, 1 << 20


def fixed_order(fn: Callable) -> Callable:
    """``fn`` with every floating-point matrix product summed in contraction-index order.

    Control flow (``scan``, ``while_loop``, ``cond``/``switch``), ``jit`` and custom
    derivative rules inside ``fn`` are followed; any other primitive runs as it is.
    """

    def wrapped(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = _evaluate(closed, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return wrapped


def ordered_dot_general(lhs, rhs, dimension_numbers, preferred_element_type=None, **_) -> jax.Array:
    """``lax.dot_general`` with each output element summed in contraction-index order.

    The operands are cast to the result dtype first (exact for the float widenings a
    ``preferred_element_type`` asks for); ``precision`` does not apply: the products and
    sums are in the result dtype.
    """
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    dtype = preferred_element_type or jnp.result_type(lhs, rhs)
    lhs_free = [d for d in range(lhs.ndim) if d not in lhs_contract and d not in lhs_batch]
    rhs_free = [d for d in range(rhs.ndim) if d not in rhs_contract and d not in rhs_batch]
    batch_shape = [lhs.shape[d] for d in lhs_batch]
    out_shape = (*batch_shape, *(lhs.shape[d] for d in lhs_free), *(rhs.shape[d] for d in rhs_free))
    k = math.prod(lhs.shape[d] for d in lhs_contract)
    b = math.prod(batch_shape)
    m, n = math.prod(lhs.shape[d] for d in lhs_free), math.prod(rhs.shape[d] for d in rhs_free)
    if k == 0:
        return jnp.zeros(out_shape, dtype)
    # Chunks of contraction indices; at least 3, so the loop below runs at least twice
    # (XLA inlines a loop of one iteration, and the products would meet the adds again).
    chunk = max(1, min(CHUNK, -(-k // 3), CHUNK_ELEMENTS // max(b * m * n, 1)))
    chunks = max(3, -(-k // chunk))

    def operand(x, contract, batch, free, shape):
        x = jnp.transpose(x, (*contract, *batch, *free)).reshape(k, *shape).astype(dtype)
        x = jnp.pad(x, ((0, chunks * chunk - k),) + ((0, 0),) * len(shape))  # zero products add nothing
        return x.reshape(chunks, chunk, *shape)

    left = operand(lhs, lhs_contract, lhs_batch, lhs_free, (b, m, 1))
    right = operand(rhs, rhs_contract, rhs_batch, rhs_free, (b, 1, n))

    def add_in_order(acc, products):
        for i in range(chunk):
            acc = acc + products[i]
        return acc

    def fold(carry, pair):
        # A chunk's products reach the adds through the loop's state, one iteration later, so
        # no add has a multiply in its expression for XLA:CPU to fuse into a multiply-add
        # (which it does for some shapes and not others).
        acc, products = carry
        return (add_in_order(acc, products), pair[0] * pair[1]), None

    first = left[0] * right[0]
    zero = jax.lax.full_like(first[0], -0.0)  # -0.0 + p is p, signed zeros too; varies as first does
    acc, products = jax.lax.scan(fold, (zero, first), (left[1:], right[1:]))[0]
    return add_in_order(acc, products).reshape(out_shape)


def _is_float_dot(eqn) -> bool:
    return eqn.primitive is prims.dot_general_p and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.inexact)


def _evaluate(closed: ClosedJaxpr, args: list) -> list:
    """Evaluates ``closed`` on ``args`` (traced or concrete), float products in fixed order."""
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = {}

    def read(var):
        return var.val if isinstance(var, Literal) else env[var]

    env.update(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        outs = _apply(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _as_fn(closed: ClosedJaxpr) -> Callable:
    return lambda *args: _evaluate(closed, list(args))


def _apply(eqn, invals: list) -> list:
    """One equation: a float product in fixed order; control flow and calls followed."""
    prim, params = eqn.primitive, eqn.params
    if _is_float_dot(eqn):
        return [ordered_dot_general(*invals, **params)]
    if prim in (prims.jit_p, prims.custom_jvp_call_p, prims.custom_vjp_call_p):
        # Evaluated for their value: the derivative rules were applied when ``fn`` was traced.
        body = params["jaxpr"] if prim is prims.jit_p else params["call_jaxpr"]
        return _evaluate(body, invals)
    if prim is prims.scan_p:
        return _scan(params, invals)
    if prim is prims.while_p:
        return _while(params, invals)
    if prim is prims.cond_p:
        index, *operands = invals
        return list(jax.lax.switch(index, [_as_fn(b) for b in params["branches"]], *operands))
    with eqn.ctx.manager:
        out = prim.bind(*invals, **prim.get_bind_params(params))
    return list(out) if prim.multiple_results else [out]


def _scan(params: dict, invals: list) -> list:
    num_consts, num_carry = params["num_consts"], params["num_carry"]
    consts, rest = invals[:num_consts], invals[num_consts:]
    carry, xs = rest[:num_carry], rest[num_carry:]
    body = _as_fn(params["jaxpr"])

    def step(carry, x):
        out = body(*consts, *carry, *x)
        return out[:num_carry], out[num_carry:]

    carry, ys = jax.lax.scan(
        step, carry, xs, length=params["length"], reverse=params["reverse"], unroll=params["unroll"]
    )
    return [*carry, *ys]


def _while(params: dict, invals: list) -> list:
    cond_n, body_n = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, init = invals[:cond_n], invals[cond_n : cond_n + body_n], invals[cond_n + body_n :]
    cond, body = _as_fn(params["cond_jaxpr"]), _as_fn(params["body_jaxpr"])

    def pred(state):
        return cond(*cond_consts, *state)[0]

    if not params["cond_jaxpr"].out_avals[0].shape:
        return list(jax.lax.while_loop(pred, lambda s: tuple(body(*body_consts, *s)), tuple(init)))

    # A batched predicate (vmap's while, e.g. GroupBy's per-key sketch folds): as XLA lowers it, the loop
    # runs while any element's holds and advances only those elements (the predicate leads every carry's shape).
    def step(state):
        keep = pred(state)
        new = body(*body_consts, *state)
        lead = lambda x: keep.reshape(keep.shape + (1,) * (x.ndim - keep.ndim))  # noqa: E731
        return tuple(jnp.where(lead(x), n, x) for n, x in zip(new, state, strict=True))

    return list(jax.lax.while_loop(lambda s: jnp.any(pred(s)), step, tuple(init)))
