"""etcd's own gRPC API for the requests the etcd engine sends most: key reads and
transactions, puts, deletes, leases and authentication.

Why: through etcd's JSON gateway every request is an HTTP/1.1 POST that the member
turns into a gRPC call to itself, and the client encodes and decodes JSON in Python
(httpx). Measured on one machine against a 3-member TLS cluster with a password
(tools/bench_etcd_client.py, docs/benchmarks.md): a read takes 0.8-1.2 ms over gRPC
against 1.6-2.0 ms through the gateway, a one-key transaction 1.3-1.4 ms against
2.9-3.0 ms, and 16 concurrent readers get 4x the gateway's reads per second for the
same CPU.

``GrpcApi.call(endpoint, path, body, token, timeout)`` takes and answers the gateway's
JSON shapes (``path`` as the gateway names it, bytes as base64 text, int64 as decimal
text, defaults left out), so the engine (``Gateway._call`` in etcd_gateway.py: failover,
retries, token renewal) is the same whichever way a request goes: an answer is
``(status, data)`` with ``status`` the HTTP status the gateway would give and ``data``
its JSON body (``{"code": gRPC code, "message": ...}`` for an error). Paths not in
``METHODS`` (watch, maintenance, compaction, setting up users) use the gateway.

The calls are grpcio's blocking ones, each on a worker thread (``trio.to_thread``,
abandoned if the engine gives up on the request: a mutation sent again is idempotent,
see etcd.py); each call carries its own deadline, so an abandoned thread ends by
itself. One channel per member, opened on first use, with the URL's CA and client
certificate; the token goes in the ``token`` metadata, as etcd's own clients send it.
"""
from __future__ import annotations

import base64
import os

# grpc's C core logs failed handshakes and such to stderr itself; the engine reports
# what they mean (one line, etcd_gateway.py)
os.environ.setdefault("GRPC_VERBOSITY", "NONE")
import grpc  # noqa: E402
import trio  # noqa: E402

from ..wire import etcd_rpc_pb2 as pb  # noqa: E402
from .etcd_auth import EtcdAccess  # noqa: E402

_b64e = base64.b64encode
_b64d = base64.b64decode

# the HTTP status etcd's gateway answers for each gRPC status code
_HTTP = {grpc.StatusCode.CANCELLED: 408, grpc.StatusCode.UNKNOWN: 500,
         grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
         grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.ALREADY_EXISTS: 409,
         grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.UNAUTHENTICATED: 401,
         grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.FAILED_PRECONDITION: 412,
         grpc.StatusCode.ABORTED: 409, grpc.StatusCode.OUT_OF_RANGE: 400,
         grpc.StatusCode.UNIMPLEMENTED: 501, grpc.StatusCode.INTERNAL: 500,
         grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DATA_LOSS: 500}


def _s(b: bytes) -> str:
    return _b64e(b).decode()


def _header(h) -> dict:
    return {"revision": str(h.revision), "member_id": str(h.member_id),
            "raft_term": str(h.raft_term)}


# -- requests: the gateway's JSON body -> the message ---------------------------------
def _range_req(body: dict) -> pb.RangeRequest:
    r = pb.RangeRequest(key=_b64d(body.get("key", "")))
    if "range_end" in body:
        r.range_end = _b64d(body["range_end"])
    if "limit" in body:
        r.limit = int(body["limit"])
    if "revision" in body:
        r.revision = int(body["revision"])
    r.serializable = bool(body.get("serializable", False))
    r.keys_only = bool(body.get("keys_only", False))
    r.count_only = bool(body.get("count_only", False))
    return r


def _put_req(body: dict) -> pb.PutRequest:
    return pb.PutRequest(key=_b64d(body["key"]), value=_b64d(body.get("value", "")),
                         lease=int(body.get("lease", 0)), prev_kv=bool(body.get("prev_kv")))


def _delete_req(body: dict) -> pb.DeleteRangeRequest:
    r = pb.DeleteRangeRequest(key=_b64d(body["key"]), prev_kv=bool(body.get("prev_kv")))
    if "range_end" in body:
        r.range_end = _b64d(body["range_end"])
    return r


_TARGET_FIELD = {"VERSION": "version", "CREATE": "create_revision", "MOD": "mod_revision",
                 "VALUE": "value", "LEASE": "lease"}


def _compare(c: dict) -> pb.Compare:
    target = c.get("target", "VERSION")
    out = pb.Compare(key=_b64d(c["key"]), target=pb.Compare.CompareTarget.Value(target),
                     result=pb.Compare.CompareResult.Value(c.get("result", "EQUAL")))
    if "range_end" in c:
        out.range_end = _b64d(c["range_end"])
    field = _TARGET_FIELD[target]
    if field == "value":
        out.value = _b64d(c.get("value", ""))
    else:
        setattr(out, field, int(c.get(field, 0)))
    return out


def _op(op: dict) -> pb.RequestOp:
    if "request_put" in op:
        return pb.RequestOp(request_put=_put_req(op["request_put"]))
    if "request_range" in op:
        return pb.RequestOp(request_range=_range_req(op["request_range"]))
    if "request_delete_range" in op:
        return pb.RequestOp(request_delete_range=_delete_req(op["request_delete_range"]))
    return pb.RequestOp(request_txn=_txn_req(op["request_txn"]))


def _txn_req(body: dict) -> pb.TxnRequest:
    return pb.TxnRequest(compare=[_compare(c) for c in body.get("compare", ())],
                         success=[_op(o) for o in body.get("success", ())],
                         failure=[_op(o) for o in body.get("failure", ())])


# -- answers: the message -> the gateway's JSON ---------------------------------------
def _kv(kv) -> dict:
    out = {"key": _s(kv.key), "create_revision": str(kv.create_revision),
           "mod_revision": str(kv.mod_revision), "version": str(kv.version)}
    if kv.value:
        out["value"] = _s(kv.value)
    if kv.lease:
        out["lease"] = str(kv.lease)
    return out


def _range_ans(r) -> dict:
    out = {"header": _header(r.header)}
    if r.kvs:
        out["kvs"] = [_kv(kv) for kv in r.kvs]
    if r.more:
        out["more"] = True
    if r.count:
        out["count"] = str(r.count)
    return out


def _put_ans(r) -> dict:
    out = {"header": _header(r.header)}
    if r.HasField("prev_kv"):
        out["prev_kv"] = _kv(r.prev_kv)
    return out


def _delete_ans(r) -> dict:
    out = {"header": _header(r.header)}
    if r.deleted:
        out["deleted"] = str(r.deleted)
    if r.prev_kvs:
        out["prev_kvs"] = [_kv(kv) for kv in r.prev_kvs]
    return out


def _txn_ans(r) -> dict:
    out: dict = {"header": _header(r.header)}
    if r.succeeded:
        out["succeeded"] = True
    responses = []
    for op in r.responses:
        kind = op.WhichOneof("response")
        conv = {"response_range": _range_ans, "response_put": _put_ans,
                "response_delete_range": _delete_ans, "response_txn": _txn_ans}[kind]
        responses.append({kind: conv(getattr(op, kind))})
    if responses:
        out["responses"] = responses
    return out


def _lease_ans(r) -> dict:
    out = {"header": _header(r.header)}
    if getattr(r, "ID", 0):
        out["ID"] = str(r.ID)
    if getattr(r, "TTL", 0):
        out["TTL"] = str(r.TTL)
    if getattr(r, "error", ""):
        out["error"] = r.error
    return out


def _lease_req(cls):
    return lambda body: cls(**{k: int(v) for k, v in body.items() if k in ("ID", "TTL")})


def _auth_req(body: dict) -> pb.AuthenticateRequest:
    return pb.AuthenticateRequest(name=body.get("name", ""), password=body.get("password", ""))


def _auth_ans(r) -> dict:
    return {"header": _header(r.header), "token": r.token}


# gateway path -> (gRPC method, kind, request class, answer class, body -> request,
# answer -> JSON); kind "stream" is a bidirectional stream sent one request
METHODS = {
    "/v3/kv/range": ("/etcdserverpb.KV/Range", "unary", pb.RangeResponse, _range_req, _range_ans),
    "/v3/kv/txn": ("/etcdserverpb.KV/Txn", "unary", pb.TxnResponse, _txn_req, _txn_ans),
    "/v3/kv/put": ("/etcdserverpb.KV/Put", "unary", pb.PutResponse, _put_req, _put_ans),
    "/v3/kv/deleterange": ("/etcdserverpb.KV/DeleteRange", "unary", pb.DeleteRangeResponse,
                           _delete_req, _delete_ans),
    "/v3/lease/grant": ("/etcdserverpb.Lease/LeaseGrant", "unary", pb.LeaseGrantResponse,
                        _lease_req(pb.LeaseGrantRequest), _lease_ans),
    "/v3/lease/revoke": ("/etcdserverpb.Lease/LeaseRevoke", "unary", pb.LeaseRevokeResponse,
                         _lease_req(pb.LeaseRevokeRequest), _lease_ans),
    "/v3/lease/keepalive": ("/etcdserverpb.Lease/LeaseKeepAlive", "stream",
                            pb.LeaseKeepAliveResponse, _lease_req(pb.LeaseKeepAliveRequest),
                            _lease_ans),
    "/v3/auth/authenticate": ("/etcdserverpb.Auth/Authenticate", "unary",
                              pb.AuthenticateResponse, _auth_req, _auth_ans),
}


class GrpcApi:
    """Channels to the members of one cluster (see the module doc)."""

    def __init__(self, access: EtcdAccess):
        self.access = access
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[tuple[str, str], object] = {}
        self._creds = None
        if access.tls is not None:
            files = access.files

            def read(name):
                path = files.get(name)
                if path is None:
                    return None
                with open(path, "rb") as f:
                    return f.read()
            self._creds = grpc.ssl_channel_credentials(read("cacert"), read("key"), read("cert"))
        # its own threads: a stalled member does not take the data path's workers
        self._limiter = trio.CapacityLimiter(32)
        self.calls = 0  # statistics

    def _stub(self, endpoint: str, path: str):
        stub = self._stubs.get((endpoint, path))
        if stub is None:
            ch = self._channels.get(endpoint)
            if ch is None:
                target = endpoint.split("://", 1)[-1]
                opts = [("grpc.max_receive_message_length", 256 << 20),
                        ("grpc.max_send_message_length", 64 << 20)]
                ch = (grpc.secure_channel(target, self._creds, options=opts)
                      if self._creds is not None else grpc.insecure_channel(target, options=opts))
                self._channels[endpoint] = ch
            method, kind, answer, _, _ = METHODS[path]
            make = ch.unary_unary if kind == "unary" else ch.stream_stream
            stub = make(method, request_serializer=lambda m: m.SerializeToString(),
                        response_deserializer=answer.FromString)
            self._stubs[(endpoint, path)] = stub
        return stub

    def _blocking(self, endpoint: str, path: str, body: dict, token: str | None,
                  timeout: float) -> tuple[int, dict]:
        _, kind, _, to_request, to_json = METHODS[path]
        stub = self._stub(endpoint, path)
        request = to_request(body)
        metadata = (("token", token),) if token else None
        try:
            if kind == "unary":
                answer = stub(request, timeout=timeout, metadata=metadata)
            else:
                stream = stub(iter((request,)), timeout=timeout, metadata=metadata)
                answer = next(stream)
                stream.cancel()
        except grpc.RpcError as e:
            code = e.code()
            return _HTTP.get(code, 500), {"code": code.value[0], "message": e.details() or str(code)}
        except StopIteration:
            return 503, {"code": 14, "message": "the stream ended without an answer"}
        return 200, to_json(answer)

    async def call(self, endpoint: str, path: str, body: dict, token: str | None,
                   timeout: float) -> tuple[int, dict]:
        """One request to the member at ``endpoint``: ``(HTTP status, JSON answer)``
        as the gateway would give them (see the module doc)."""
        self.calls += 1
        return await trio.to_thread.run_sync(self._blocking, endpoint, path, body, token,
                                             timeout, abandon_on_cancel=True,
                                             limiter=self._limiter)

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
        self._stubs.clear()
