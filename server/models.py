"""Pydantic models of every JSON body the service reads or writes.

The limits here (id ranges, list lengths, shapes) are the first line of validation: a request
that gets past them reaches the worker, which validates the IR and the field references.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from difftape.graph import wire

DTypeName = Literal["f16", "f32", "f64", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32",
                    "u64"]
# "data" and "primal" are the same storage; "grad_dual" is x.grad.dual (forward-over-reverse);
# "mark" holds the read marks of Tape(validation=True) (i8).
Role = Literal["data", "primal", "grad", "dual", "grad_dual", "mark"]
CompanionRole = Literal["grad", "dual", "grad_dual", "mark"]
Variant = Literal["primal", "grad", "fwd", "grad_fwd", "fwd_const"]
FieldId = Annotated[int, Field(ge=1, lt=2**31)]
Dim = Annotated[int, Field(ge=1, lt=2**31)]
# A field's offset= along one axis (its first index; the engine checks that every index,
# offset added, is an i32).
Offset = Annotated[int, Field(ge=-2**31, lt=2**31)]
Number = int | float
# JSON has no inf/NaN: they travel as these strings (both directions).
NonFinite = Literal["NaN", "-NaN", "Infinity", "-Infinity"]
Scalarish = Number | NonFinite | list[Number | NonFinite] | list[list[Number | NonFinite]]
KernelId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------- sessions
class SessionResources(Strict):
    """What a session's engine reserves on a cluster (``difftape serve --cluster``): CPUs
    and GPUs, a fraction of a GPU (< 1) to share one device with other sessions."""

    cpus: float | None = Field(default=None, gt=0, le=1024)
    gpus: float | None = Field(default=None, ge=0, le=64)


class SessionCreate(Strict):
    """Body of ``POST /v1/sessions`` (optional)."""

    resources: SessionResources | None = None


class SessionInfo(BaseModel):
    session_id: str
    arch: str
    state: Literal["active", "culled", "lost"]
    field_bytes: int
    created: float
    last_activity: float
    lost_reason: str | None = None
    # The scratch memory the user's quota reserves for the session's running engine (stack
    # pools, print buffers...): counted with field_bytes; 0 while no engine runs it.
    scratch_bytes: int = 0


class SessionList(BaseModel):
    sessions: list[SessionInfo]


# ---------------------------------------------------------------------- engine ops
class SparseLevel(Strict):
    """One sparse SNode above a field's cells: the field holding its activity (a byte per
    cell, or a length per list when ``dynamic``) and, per activity axis, the field's axis
    and the divisor that maps a field index to it (a list's own axis last)."""

    activity: FieldId
    map: list[Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]],
                        Field(min_length=2, max_length=2)]] = Field(max_length=8)
    dynamic: bool = False


class CreateFieldOp(Strict):
    op: Literal["create_field"] = "create_field"
    id: FieldId
    dtype: DTypeName
    shape: list[Dim] = Field(max_length=8)
    element_shape: list[Dim] = Field(default=[], max_length=2)
    # Taichi's offset= (the index of the first element along each axis); none: from 0.
    offset: list[Offset] = Field(default=[], max_length=8)
    needs_grad: bool = False
    needs_dual: bool = False
    name: str | None = Field(default=None, max_length=200)
    # A ti.ndarray's storage (bound to kernel arguments by launches), not a field.
    ndarray: bool = False
    # Under sparse SNodes: the levels above its cells (checked by the engine).
    sparse: list[SparseLevel] = Field(default=[], max_length=8)


class CompanionOp(Strict):
    op: Literal["companion"] = "companion"
    id: FieldId
    role: CompanionRole


class ZeroOp(Strict):
    """Zero a storage whole, active cells or not (``deactivate_all``)."""

    op: Literal["zero"] = "zero"
    id: FieldId
    role: Role = "data"


class FillOp(Strict):
    op: Literal["fill"] = "fill"
    id: FieldId
    role: Role = "data"
    value: Scalarish


class SetItemOp(Strict):
    op: Literal["set_item"] = "set_item"
    id: FieldId
    role: Role = "data"
    index: list[int] = Field(max_length=8)
    value: Scalarish


class GetItemOp(Strict):
    op: Literal["get_item"] = "get_item"
    id: FieldId
    role: Role = "data"
    index: list[int] = Field(max_length=8)


class GetBytesOp(Strict):
    op: Literal["get_bytes"] = "get_bytes"
    id: FieldId
    role: Role = "data"


class SetBytesOp(Strict):
    op: Literal["set_bytes"] = "set_bytes"
    id: FieldId
    role: Role = "data"
    b64: str = Field(max_length=(1 << 20) * 4 // 3 + 4)


class RegisterOp(Strict):
    op: Literal["register"] = "register"
    ir: dict[str, Any]


class ArrayArg(Strict):
    """A launch's ``ti.types.ndarray()`` argument: kernel argument ``arg`` is the ndarray
    ``id``; ``grad``: the kernel is compiled with its ``.grad``."""

    arg: Annotated[int, Field(ge=0, lt=1024)]
    id: FieldId
    grad: bool = False


ArrayArgs = Annotated[list[ArrayArg], Field(max_length=1024)]


class LaunchOp(Strict):
    op: Literal["launch"] = "launch"
    kernel_id: KernelId
    variant: Variant = "primal"
    args: list[Number] = Field(default=[], max_length=4096)
    arrays: ArrayArgs = []


class ClearGradsOp(Strict):
    op: Literal["clear_grads"] = "clear_grads"


class ClearDualsOp(Strict):
    op: Literal["clear_duals"] = "clear_duals"


class SeedOp(Strict):
    op: Literal["seed"] = "seed"
    value: Annotated[int, Field(ge=0, lt=2**63)]


# What a sweep or grad_check repeats: ops that neither create nor read anything.
ProgramOp = Annotated[
    LaunchOp | FillOp | SetItemOp | SetBytesOp | ZeroOp | ClearGradsOp | ClearDualsOp,
    Field(discriminator="op"),
]
Program = Annotated[list[ProgramOp], Field(max_length=100_000)]


class Storages(Strict):
    role: Role
    fields: list[FieldId] = Field(max_length=10_000)


class SweepOp(Strict):
    """Columns of a derivative matrix (``ti.ad.jacobian``/``hessian``/``hvp``, see
    PROTOCOL.md); ``vectors``: explicit seeds, or null for one-hot ones."""

    op: Literal["sweep"] = "sweep"
    before: Program = []
    clear: Literal["clear_duals", "clear_grads"]
    seed: Storages
    # float64 seed vectors, C order, base64 (arrays travel as bytes, not lists of numbers)
    vectors: Annotated[str, Field(max_length=64 << 20)] | None = None
    program: Program
    read: Storages
    after: Program = []


class NewtonOp(Strict):
    """``ti.ad.newton`` in one op: the recorded ``value_grad`` (Tape over the loss),
    ``hessian`` (forward-over-reverse) and ``primal`` programs, see PROTOCOL.md."""

    op: Literal["newton"] = "newton"
    loss: FieldId
    params: list[FieldId] = Field(min_length=1, max_length=10_000)
    tol: Annotated[float, Field(ge=0)]
    max_iter: Annotated[int, Field(ge=0, le=10_000)]
    value_grad: Program
    hessian: Program
    primal: Program


class SnapshotOp(Strict):
    op: Literal["snapshot"] = "snapshot"
    key: Annotated[int, Field(ge=0, lt=2**63)]


class GradCheckOp(Strict):
    op: Literal["grad_check"] = "grad_check"
    snapshot: Annotated[int, Field(ge=0, lt=2**63)]
    loss: FieldId
    fields: list[FieldId] = Field(max_length=10_000)
    labels: list[Annotated[str, Field(max_length=200)]] | None = Field(default=None,
                                                                       max_length=10_000)
    program: Program


GraphId = Annotated[str, Field(pattern=wire.GRAPH_ID_PATTERN)]


class GraphCreateOp(Strict):
    """A captured (or saved) graph's document, see ``difftape.graph.wire``; ``graph_id``:
    its content hash; ``fields``: the document's field ids -> the session's (default: the
    same)."""

    op: Literal["graph_create"] = wire.GRAPH_CREATE
    graph_id: GraphId
    graph: dict[str, Any]
    fields: dict[str, FieldId] | None = Field(default=None, max_length=100_000)


class GraphReplayOp(Strict):
    """Replay a graph of the session; ``inputs`` by name (``difftape.graph.wire``: numbers,
    flat lists of entries, ``{"field": id}``, ``{"ndarray": id, "b64"?: bytes}``)."""

    op: Literal["graph_replay"] = wire.GRAPH_REPLAY
    graph_id: GraphId
    inputs: dict[str, Any] = Field(default={}, max_length=wire.MAX_INPUTS)


BatchOp = Annotated[
    CreateFieldOp | CompanionOp | FillOp | SetItemOp | GetItemOp | GetBytesOp | SetBytesOp
    | ZeroOp | RegisterOp | LaunchOp | ClearGradsOp | ClearDualsOp | SeedOp | SweepOp | NewtonOp
    | SnapshotOp | GradCheckOp | GraphCreateOp | GraphReplayOp,
    Field(discriminator="op"),
]


def op_count(ops: list[dict]) -> int:
    """Ops a batch or job carries, those inside sweep/newton/grad_check programs included
    (the ``batch_ops`` quota)."""
    n = len(ops)
    for op in ops:
        for key in ("before", "program", "after", "value_grad", "hessian", "primal"):
            inner = op.get(key)
            if isinstance(inner, list):
                n += len(inner)
    return n


class FieldCreate(Strict):
    """Body of ``POST /v1/sessions/{sid}/fields``."""

    id: FieldId
    dtype: DTypeName
    shape: list[Dim] = Field(max_length=8)
    element_shape: list[Dim] = Field(default=[], max_length=2)
    # Taichi's offset= (the index of the first element along each axis); none: from 0.
    offset: list[Offset] = Field(default=[], max_length=8)
    needs_grad: bool = False
    needs_dual: bool = False
    name: str | None = Field(default=None, max_length=200)
    # A ti.ndarray's storage (bound to kernel arguments by launches), not a field.
    ndarray: bool = False
    # Under sparse SNodes: the levels above its cells (checked by the engine).
    sparse: list[SparseLevel] = Field(default=[], max_length=8)


class FieldCreated(BaseModel):
    id: int
    nbytes: int


class FillBody(Strict):
    value: Scalarish


class CompanionBody(Strict):
    role: CompanionRole


class ItemBody(Strict):
    index: list[int] = Field(max_length=8)
    value: Scalarish


class ItemValue(BaseModel):
    value: Any


# ---------------------------------------------------------------------- kernels
class KernelRegister(Strict):
    """``ir``: ``difftape.ir.serialize.encode`` of the kernel's frontend IR."""

    ir: dict[str, Any]


class KernelRegistered(BaseModel):
    kernel_id: str


class LaunchBody(Strict):
    variant: Variant = "primal"
    args: list[Number] = Field(default=[], max_length=4096)
    arrays: ArrayArgs = []


class LaunchResult(BaseModel):
    result: Any = None


# ---------------------------------------------------------------------- batch and jobs
class BatchBody(Strict):
    ops: list[BatchOp] = Field(max_length=100_000)


class PrintedOutput(BaseModel):
    """What a request's kernels printed (``difftape.graph.wire``): the text's bytes in
    base64, at most ``wire.MAX_OUTPUT_BYTES`` of them, and how many lines past that were
    dropped."""

    b64: str
    dropped: int = 0


class BatchResult(BaseModel):
    results: list[Any]
    output: PrintedOutput | None = None


class JobSubmit(Strict):
    ops: list[BatchOp] = Field(min_length=1, max_length=100_000)
    job_id: str | None = Field(default=None, min_length=1, max_length=128,
                               pattern=r"^[A-Za-z0-9_.:-]+$",
                               description="client-chosen id: resubmitting it runs nothing "
                                           "new and returns the same job")


JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]


class JobInfo(BaseModel):
    job_id: str
    session_id: str
    state: JobState
    done: int
    total: int
    created: float
    started: float | None = None
    finished: float | None = None
    problem: dict | None = None


class JobResult(BaseModel):
    job_id: str
    results: list[Any]
    output: PrintedOutput | None = None


class Problem(BaseModel):
    """RFC 7807 problem body of every error response."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str
    difftape_error: str | None = None
    kernel: str | None = None
    #: A compile error's ``{"file", "line", "source_line"}`` (``difftape.errors.error_location``):
    #: the client's line that the kernel's IR carried, which the client's message names.
    location: dict[str, Any] | None = None
    #: What the request's kernels printed before the error (``difftape.graph.wire``).
    output: PrintedOutput | None = None


class Health(BaseModel):
    status: str
    checks: dict[str, Any] = {}
    # /readyz of a CUDA server: the device (name, ordinal, memory used and total in bytes,
    # utilisation in percent where NVML is available), as the workers last reported it
    device: dict[str, Any] | None = None
