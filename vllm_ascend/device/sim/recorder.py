"""Capturing an ACL graph: a dispatcher-level recorder of the device ops a capture issues.

Each device op is kept with its tensor arguments by identity and every other argument (ints,
lists, floats) by value. Matrix products are recorded unrun (``UNRUN``), as the chip records a
captured task: the output holds garbage until a replay, and attention kernels run their checks
only (``aclnn.CAPTURING``). Ops implemented in Python (vLLM's attention and KV-update custom ops,
which read the forward context) are not recorded whole: their CPU kernel runs under the
recorder, so the device ops they issue are what is recorded. A host synchronisation
(``.item()``, ``.tolist()``) or a device-to-host copy (``.cpu()``, ``.numpy()``, ``.to("cpu")``)
during capture raises, as on the chip. ``to_slots`` turns the record into one that names the
tensors it made by slot, for sim/graph.py to place them in the graph's pool.
"""

import weakref

import torch
from torch._C import DispatchKey
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_ascend.device.sim import ledger as _ledger
from vllm_ascend.device.sim.aclnn import CAPTURING
from vllm_ascend.device.sim.errors import GraphCaptureError
from vllm_ascend.device.sim.graph_pool import storage_key

_RECORDED_NAMESPACES = {"aten", "prims", "ascend_sim"}
_UNCAPTURABLE_NAMESPACES = {"_c10d_functional", "_c10d_functional_autograd", "c10d_functional"}


def _plain(*tensors) -> bool:
    """Plain tensors or parameters (weights), not subclasses that run code of their own."""
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


def _product_shape(a, b):
    """(shape, dtype) of ``a @ b`` (mm, bmm), or None where the kernel should run."""
    if (_plain(a, b) and a.dtype == b.dtype
            and a.is_floating_point() and a.dim() == b.dim() and a.dim() in (2, 3)
            and a.shape[-1] == b.shape[-2] and a.shape[:-2] == b.shape[:-2]):
        return (*a.shape[:-1], b.shape[-1]), a.dtype
    return None  # run it: the kernel's own error, or a case not worth recording unrun


# Matrix products, most of a capture's time on the CPU, are recorded without running, as the chip
# records a captured task (it runs at replay only): their result is garbage until a replay fills
# it, so code that reads a capture's output sees garbage here too. Shapes the kernel would refuse
# run and raise as before.
def _biased_shape(bias, a, b, **scales):
    """The same for addmm (``bias`` broadcast to the product's shape)."""
    result = _product_shape(a, b)
    if result is None or not _plain(bias) or bias.dtype != a.dtype:
        return None
    try:
        return result if torch.broadcast_shapes(bias.shape, result[0]) == result[0] else None
    except RuntimeError:
        return None


def _linear_shape(x, weight, bias=None):
    """The same for linear, ``x @ weight.T + bias`` (vLLM's unquantized layers call it whole)."""
    if x.dim() < 1 or weight.dim() != 2:
        return None
    result = _product_shape(x.reshape(-1, x.shape[-1]), weight.t())
    if result is None or (bias is not None and (not _plain(bias) or bias.dtype != x.dtype
                                                or bias.shape != weight.shape[:1])):
        return None
    return (*x.shape[:-1], weight.shape[0]), x.dtype


_UNRUN = {torch.ops.aten.mm.default: _product_shape, torch.ops.aten.bmm.default: _product_shape,
          torch.ops.aten.addmm.default: _biased_shape, torch.ops.aten.linear.default: _linear_shape}


class Node:
    __slots__ = ("func", "args", "kwargs", "outs", "group")

    def __init__(self, func, args, kwargs, outs, group):
        self.func, self.args, self.kwargs, self.outs, self.group = func, args, kwargs, outs, group


class Wait:
    """A captured ``ExternalEvent.wait``: replay stops here until the event is recorded."""

    def __init__(self, event):
        self.event = event


class HostCall:
    """A host-side graph node (an ExternalEvent reset): replay calls ``fn()`` here."""

    def __init__(self, fn):
        self.fn = fn


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.nodes: list = []  # Node, Wait or HostCall
        self.group = None  # the open task group's id, if any

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ledger.HOST_SYNCS:  # a capture cannot contain them
            raise GraphCaptureError(
                "a host synchronisation (.item() / bool(tensor)) happened during graph capture; "
                "on the chip this fails the capture. Move the host read out of the captured "
                "region (compute it before the forward) or run this model eagerly.")
        if func.namespace == "c10d":
            # A collective (torch.distributed on the device's process group): recorded whole,
            # as the chip captures an HCCL collective; replay issues it again and waits for it.
            out = func(*args, **kwargs)
            self.nodes.append(Node(func, args, kwargs, out, self.group))
            return out
        if func.namespace in _UNCAPTURABLE_NAMESPACES:
            raise GraphCaptureError(
                f"{func} was issued during graph capture: functional collectives complete "
                "asynchronously into tensors the graph pool reuses, and are not captured. Issue "
                "collectives through torch.distributed on the process group (in place), as "
                "vLLM's device communicator does, or run this model eagerly.")
        if func.namespace not in _RECORDED_NAMESPACES:
            # Implemented in Python: record the device ops it issues, not the call itself.
            with self:
                return func._op_dk(DispatchKey.CPU, *args, **kwargs)
        unrun = _UNRUN.get(func)
        result = unrun(*args, **kwargs) if unrun is not None else None
        if result is not None:
            out = CAPTURING.unwritten(torch.empty(result[0], dtype=result[1]))
        else:
            out = func(*args, **kwargs)
        self.nodes.append(Node(func, args, kwargs, out, self.group))
        return out


def _host_copy_error(what: str) -> GraphCaptureError:
    return GraphCaptureError(
        f"a device-to-host copy ({what}) happened during graph capture; on the chip this fails "
        "the capture. Read host values before the captured region.")


def _refusing(name: str):
    def refuse(self, *args, **kwargs):
        raise _host_copy_error(f".{name}()")
    return refuse


def to_refusing_host(original):
    """Tensor.to during capture: a copy to "cpu" named as a string is the host (vLLM and
    upstream write device copies with the device object, which on the simulator is the CPU)."""
    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, str) and target.split(":")[0] == "cpu":
            raise _host_copy_error(f'.to("{target}")')
        return original(self, *args, **kwargs)
    return to


# Tensor methods that copy device memory to the host without a dispatcher op the recorder sees
# (on the simulator the device tensor already is a host tensor).
HOST_COPIES = {"tolist": _refusing("tolist"), "numpy": _refusing("numpy"),
                "cpu": _refusing("cpu")}


def tensors_in(tree, found=None) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results (lists, tuples and dicts of them): a plain
    walk, as pytree's flatten took a tenth of a capture's time."""
    found = [] if found is None else found
    if isinstance(tree, torch.Tensor):
        found.append(tree)
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            tensors_in(x, found)
    elif isinstance(tree, dict):
        for x in tree.values():
            tensors_in(x, found)
    return found


def map_leaves(fn, tree):
    """``fn`` applied to every leaf of lists, tuples (named ones too) and dicts, kept in shape."""
    if isinstance(tree, list):
        return [map_leaves(fn, x) for x in tree]
    if isinstance(tree, tuple):
        items = [map_leaves(fn, x) for x in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    if isinstance(tree, dict):
        return {k: map_leaves(fn, v) for k, v in tree.items()}
    return fn(tree)


class Slot:
    """Stands for an internal tensor of the record while its liveness is decided."""

    __slots__ = ("k",)

    def __init__(self, k):
        self.k = k


class Meta:
    __slots__ = ("storage", "key", "offset", "size", "stride", "dtype")

    def __init__(self, t: torch.Tensor):
        self.storage = t.untyped_storage()
        self.key = storage_key(t)
        self.offset, self.size, self.stride, self.dtype = (t.storage_offset(), t.size(),
                                                           t.stride(), t.dtype)

    def view_of(self, storage, byte_offset: int = 0) -> torch.Tensor:
        t = torch.empty(0, dtype=self.dtype)
        return t.set_(storage, byte_offset // t.element_size() + self.offset, self.size,
                      self.stride)


def to_slots(nodes: list):
    """Replace, in place, each recorded op by (kind, func, args, kwargs, outs, group) in which
    the tensors the record produced are _Slots. Returns their metadata, the node allocating
    each storage, the last node using it, and weak references to the tensors."""
    internal: dict[int, int] = {}  # id(tensor) -> slot
    metas: list[Meta] = []
    holders: list[torch.Tensor] = []  # keeps ids unique until the weak references are taken
    first_def: dict[int, int] = {}
    last_use: dict[int, int] = {}

    def slot(x):
        if isinstance(x, torch.Tensor) and id(x) in internal:
            return Slot(internal[id(x)])
        return x

    for i, node in enumerate(nodes):
        if not isinstance(node, Node):
            continue
        ins = tensors_in((node.args, node.kwargs))
        in_keys = {storage_key(t) for t in ins}
        for t in ins:
            if id(t) in internal:
                last_use[metas[internal[id(t)]].key] = i
        outs = tensors_in(node.outs)
        mutable = node.func._schema.is_mutable
        aliased = [storage_key(o) in in_keys for o in outs]
        if not mutable and any(aliased) and not all(aliased):
            raise GraphCaptureError(f"{node.func} returns a partial alias; not simulated")
        kind = "mutate" if mutable else ("view" if outs and all(aliased) else "compute")
        for o, alias in zip(outs, aliased):
            if id(o) in internal or (mutable and alias):
                continue  # an in-place op returns its (already known) input
            internal[id(o)] = len(metas)
            metas.append(Meta(o))
            holders.append(o)
            key = metas[-1].key
            if kind != "view" and not alias:
                first_def.setdefault(key, i)
            last_use[key] = i
        nodes[i] = (kind, node.func, map_leaves(slot, node.args), map_leaves(slot, node.kwargs),
                    [slot(o) for o in outs], node.group)
    return metas, first_def, last_use, [weakref.ref(t) for t in holders]
