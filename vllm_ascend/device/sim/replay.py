"""Replaying an ACL graph: each recorded op as a prepared call, with no Python of the model in it.

A call is the op's cheapest form that writes into the graph's outputs: the simulator's own
kernels (``ascend_sim`` ops) called as the Python functions they are, without torch's dispatcher
(their replay forms, ``aclnn.REPLAY`` and ``aclnn.REPLAY_INTO``, when they register one), aten's
linear as the simulator's product (``matmul.prepare_linear``), torch's binding with ``out=``,
the ``.out`` overload, or the kernel then a copy. A collective is issued again and waited for.
"""

import torch
from torch.utils._pytree import tree_flatten, tree_map

from vllm_ascend.device.sim.aclnn import REPLAY, REPLAY_INTO
from vllm_ascend.device.sim.matmul import prepare_linear
from vllm_ascend.device.sim.recorder import tensors_in
from vllm_ascend.device.sim.trace import KERNELS

# Allocations whose contents are undefined: nothing to redo on replay.
# Allocations whose contents are undefined: nothing to redo on replay.
NO_REPLAY = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
              torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default}
# Ops whose result is a copy of their first argument.
_COPIES = {torch.ops.aten.contiguous.default, torch.ops.aten.clone.default}


_OUT_OVERLOADS: dict = {}


def _out_overload(func):
    """The ``.out`` overload taking the same arguments as ``func`` plus out tensors, if any."""
    if func in _OUT_OVERLOADS:
        return _OUT_OVERLOADS[func]
    found = None
    schema = func._schema
    want = [(a.name, str(a.type)) for a in schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        outs = [a.name for a in cand._schema.arguments if a.is_out]
        if not outs or len(outs) != len(schema.returns):
            continue
        if [(a.name, str(a.type)) for a in cand._schema.arguments if not a.is_out] == want:
            found = (cand, outs)
            break
    _OUT_OVERLOADS[func] = found
    return found


def _binding_with_out(func, args, kwargs, targets):
    """torch's own Python binding with out= (the cheapest call), if it computes the same thing."""
    if len(targets) != 1 or func.namespace != "aten":
        return None
    fn = getattr(torch._C._VariableFunctions, func.overloadpacket.__name__, None)
    if fn is None:
        return None
    scratch = torch.empty_like(targets[0])  # the target keeps what the capture left in it
    try:
        expected = func(*args, **kwargs)
        written = fn(*args, **kwargs, out=scratch)
    except Exception:
        return None
    # The binding must write into out= and return it: some (__and__, __or__) accept out= and
    # return NotImplemented without writing.
    if written is not scratch or not isinstance(expected, torch.Tensor) or \
            not torch.equal(expected, scratch):
        return None
    return fn


def compute_call(func, args, kwargs, targets, group):
    """A prepared call that recomputes ``func`` into ``targets`` (its captured outputs)."""
    if func in _COPIES:
        return (targets[0].copy_, (args[0],), {}, group)
    write = _writer(func, args, kwargs, targets)
    if write is not None:
        return (write, args, kwargs, group)
    fast = _binding_with_out(func, args, kwargs, targets)
    if fast is not None:
        return (fast, args, dict(kwargs, out=targets[0]), group)
    out = _out_overload(func)
    if out is not None:
        overload, names = out
        kw = dict(kwargs)
        kw.update(zip(names, targets))
        return (overload._op, args, kw, group)

    compute = kernel_of(func, func._op)

    def run_then_copy(*a, **kw):
        for t, r in zip(targets, tensors_in(compute(*a, **kw))):
            t.copy_(r)

    run_then_copy.func, run_then_copy.kernel = func, compute
    return (run_then_copy, args, kwargs, group)


# A replayed simulator kernel -> its op: a replay calls the kernel's Python function itself (the
# dispatcher's boxing of FIA's twenty arguments cost 13 of a decode call's 56 us).
DIRECT: dict = {}


def kernel_of(func, otherwise):
    """What a replay calls for ``func``: an ascend_sim op's replay form (aclnn.REPLAY) or Python
    kernel, else ``otherwise``."""
    if func.namespace != "ascend_sim":
        return otherwise
    overload = func._overloadname
    name = func._schema.name.split("::")[1] + ("" if overload == "default" else f".{overload}")
    fn = REPLAY.get(name) or KERNELS[name]
    DIRECT[fn] = func
    return fn


def _writer(func, args, kwargs, targets):
    """A call that writes ``func``'s results into ``targets``, if the op has one: an ascend_sim
    op's kernel (aclnn.REPLAY_INTO), aten.linear's product (matmul.prepare_linear)."""
    if func._overloadname != "default":
        return None
    if func is torch.ops.aten.linear.default:
        kernel = prepare_linear
        write = kernel(targets, *args, **kwargs)
    else:
        kernel = REPLAY_INTO.get(func._schema.name.split("::")[1]) \
            if func.namespace == "ascend_sim" else None
        if kernel is None:
            return None

        def write(*a, **kw):
            kernel(targets, *a, **kw)
    DIRECT[kernel] = func
    write.func, write.kernel = func, kernel
    return write


def op_called(fn):
    """The ascend_sim op a prepared call runs without the dispatcher, if any (for the ledger)."""
    return DIRECT.get(getattr(fn, "kernel", fn))


def describe(tree) -> str:
    return str(tree_map(lambda x: f"tensor{tuple(x.shape)}:{x.dtype}" if isinstance(
        x, torch.Tensor) else x, tree))


def group_name(process_group: torch.ScriptObject) -> str:
    # The dispatcher passes each call a fresh wrapper of the same c10d ProcessGroup.
    return torch._C._distributed_c10d.ProcessGroup.unbox(process_group).group_name


def collective(func):
    """A replayed collective: issue it again and wait for its completion (its Work)."""
    def run(*args, **kwargs):
        for x in tree_flatten(func._op(*args, **kwargs))[0]:
            if isinstance(x, torch.ScriptObject) and "Work" in str(x._type()):
                x.wait()
    return run


_ARG_NAMES: dict = {}


def flat_args(func, args, kwargs) -> dict:
    names = _ARG_NAMES.get(func)
    if names is None:
        names = _ARG_NAMES[func] = [a.name for a in func._schema.arguments]
    flat = dict(zip(names, args))
    flat.update(kwargs)
    return flat
