"""``/v1/sessions/{sid}/fields``: create fields, move their data as bytes, fill, items."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse

from .. import npyio
from ..models import (
    CompanionBody,
    FieldCreate,
    FieldCreated,
    FillBody,
    ItemBody,
    ItemValue,
    Role,
)
from ..problems import ProblemError
from .deps import PROBLEM_RESPONSES, FidP, SidP, UserDep, service

router = APIRouter(prefix="/v1/sessions/{sid}/fields", tags=["fields"],
                   responses=PROBLEM_RESPONSES)

_INDEX = r"^(-?[0-9]{1,10}(,-?[0-9]{1,10}){0,7})?$"
_BINARY = {"schema": {"type": "string", "format": "binary"}}
_UPLOAD = {"requestBody": {
    "required": True,
    "description": "`application/x-npy` (a `.npy` file, read without pickle) or "
                   "`application/octet-stream` (C-order bytes, with `X-Dtype` and `X-Shape`)",
    "content": {npyio.NPY: _BINARY, npyio.RAW: _BINARY}}}
_DOWNLOAD = {200: {"description": "`.npy` by default; raw bytes with `X-Dtype`/`X-Shape` "
                                  "headers for `Accept: application/octet-stream`",
                   "content": {npyio.NPY: _BINARY, npyio.RAW: _BINARY}}}


@router.post("", status_code=201, response_model=FieldCreated)
async def create_field(request: Request, user: UserDep, body: FieldCreate,
                       sid: SidP) -> FieldCreated:
    svc = service(request)
    svc.sessions.check(user, sid)
    op = {"op": "create_field", **body.model_dump()}
    rec = svc.sessions.created_record(op)
    with svc.sessions.reserve_fields(user, rec.total):
        result, _ = await svc.sessions.call(user, sid, op)
        svc.sessions.account_fields(sid, {body.id: rec}, [])
    return FieldCreated(id=body.id, nbytes=int(result.get("nbytes", rec.total)))


@router.post("/{fid}/companions", status_code=204)
async def add_companion(request: Request, user: UserDep, body: CompanionBody, sid: SidP,
                        fid: FidP) -> Response:
    """Allocate the field's ``.grad`` or ``.dual`` (``lazy_grad`` / ``lazy_dual``)."""
    svc = service(request)
    svc.sessions.check(user, sid)
    f = svc.db.field_records(sid, [fid]).get(fid)
    extra = f.nbytes if f is not None and body.role not in f.roles else 0
    with svc.sessions.reserve_fields(user, extra):
        await svc.sessions.call(user, sid, {"op": "companion", "id": fid, "role": body.role})
        svc.sessions.account_fields(sid, {}, [(fid, body.role)])
    return Response(status_code=204)


@router.put("/{fid}/{role}", status_code=204, openapi_extra=_UPLOAD)
async def write_field(request: Request, user: UserDep, sid: SidP, fid: FidP,
                      role: Role, content_type: Annotated[str | None, Header()] = None,
                      x_dtype: Annotated[str | None, Header()] = None,
                      x_shape: Annotated[str | None, Header()] = None) -> Response:
    """Replace the field's data (or ``.grad`` / ``.dual``) with the body's array.

    The body is read as it arrives: its header (or ``X-Shape``) is checked against the
    field first, so an array of the wrong shape is refused before its data is read, and
    the data goes straight into one buffer of the right size."""
    svc = service(request)
    svc.sessions.check(user, sid)
    ctype = (content_type or npyio.NPY).split(";")[0].strip().lower()
    if ctype not in (npyio.NPY, npyio.RAW):
        raise ProblemError(415, f"unsupported content type {ctype!r}; send {npyio.NPY} or "
                                f"{npyio.RAW}")
    rec = svc.db.field_records(sid, [fid]).get(fid)
    length = request.headers.get("content-length")
    data, dtype, shape = await npyio.read_body(
        request.stream(), ctype, x_dtype, x_shape,
        field_shape=rec.shape if rec is not None else None,
        field_label=f"field {fid} ({role})", limit=svc.settings.max_body_bytes,
        length=int(length) if length and length.isdigit() else None)
    await svc.sessions.call(user, sid, {"op": "write", "id": fid, "role": role,
                                        "dtype": dtype, "shape": shape}, data)
    svc.metrics.bytes_moved.labels("in").inc(len(data))
    return Response(status_code=204)


@router.get("/{fid}/{role}", responses=_DOWNLOAD, response_class=Response)
async def read_field(request: Request, user: UserDep, sid: SidP, fid: FidP,
                     role: Role, accept: Annotated[str | None, Header()] = None) -> Response:
    svc = service(request)
    result, payload = await svc.sessions.call(user, sid, {"op": "read", "id": fid,
                                                          "role": role})
    payload = payload or b""
    svc.metrics.bytes_moved.labels("out").inc(len(payload))
    shape = [int(x) for x in result["shape"]]
    if accept and npyio.RAW in accept and npyio.NPY not in accept:
        return Response(payload, media_type=npyio.RAW,
                        headers={"X-Dtype": npyio.numpy_name(result["dtype"]),
                                 "X-Shape": ",".join(str(x) for x in shape)})
    header = npyio.npy_header(result["dtype"], shape)

    async def parts():
        yield header
        yield payload

    return StreamingResponse(parts(), media_type=npyio.NPY,
                             headers={"Content-Length": str(len(header) + len(payload))})


@router.post("/{fid}/{role}/fill", status_code=204)
async def fill_field(request: Request, user: UserDep, body: FillBody, sid: SidP,
                     fid: FidP, role: Role) -> Response:
    await service(request).sessions.call(user, sid, {"op": "fill", "id": fid, "role": role,
                                                     "value": body.value})
    return Response(status_code=204)


@router.post("/{fid}/{role}/item", response_model=ItemValue)
async def item(request: Request, user: UserDep, body: ItemBody, sid: SidP,
               fid: FidP, role: Role) -> ItemValue:
    """Set one element (``field[i, j] = v``)."""
    await service(request).sessions.call(user, sid, {"op": "set_item", "id": fid,
                                                     "role": role, "index": body.index,
                                                     "value": body.value})
    return ItemValue(value=body.value)


@router.get("/{fid}/{role}/item", response_model=ItemValue)
async def get_item(request: Request, user: UserDep, sid: SidP, fid: FidP, role: Role,
                   index: Annotated[str, Query(pattern=_INDEX)] = "") -> ItemValue:
    """Read one element; ``index`` is comma-separated (``?index=3,4``; empty for a 0-d
    field)."""
    idx = [int(x) for x in index.split(",") if x]
    result, _ = await service(request).sessions.call(
        user, sid, {"op": "get_item", "id": fid, "role": role, "index": idx})
    return ItemValue(value=result.get("value"))
