"""etcd's JSON gateway as the etcd engine talks to it: requests, failover, tokens.

``Gateway`` is a part of :class:`~bmfs.kv.etcd.EtcdKV` (the module doc there says
how requests fail over between endpoints and what a token is for): ``_call`` POSTs a
request to the endpoint in use and moves to the next on a connection error, a
timeout or an answer another member may not give; ``_call_at`` asks one member
(status, defragmentation); ``_check`` turns an answer's error into the exception it
means. The members' maintenance calls (compaction, alarms, status, defragmentation:
what etcd_compact.py runs) are here too.
"""
from __future__ import annotations

import contextlib
import logging
import time

import httpx
import trio

from .. import metrics
from ..errors import Access, IOFailure, NoSpace, NotFound, Unavailable
from .etcd_auth import EtcdAccess, refusal, tls_refusal, token_expired

try:
    from .etcd_grpc import METHODS as GRPC_METHODS
    from .etcd_grpc import GrpcApi
except ImportError:  # grpcio missing: everything through the gateway
    GrpcApi, GRPC_METHODS = None, {}

log = logging.getLogger(__name__)
_RETRY_CODES = {4, 8, 14}       # gRPC DeadlineExceeded, ResourceExhausted, Unavailable


def _too_big(msg: str) -> str:
    """The hint for an answer saying a request exceeds an etcd limit ("" if it does not).

    These come as gRPC ResourceExhausted (HTTP 429), which otherwise means "retry
    later": retrying a request that is too big would only wait out the timeout.
    """
    if "too many operations" in msg:
        return (" (a metadata transaction with more operations than etcd allows: "
                "start etcd with a larger --max-txn-ops, e.g. 10000)")
    if "larger than max" in msg or "request is too large" in msg:
        return (" (a metadata transaction larger than etcd accepts: start etcd with a "
                "larger --max-request-bytes, e.g. 10485760)")
    return ""


class Retry(Exception):
    """An endpoint failed in a way another endpoint, or a later try, may not."""


class Expired(Retry):
    """etcd no longer takes the token sent: authenticate again (etcd_auth.py)."""


def error_text(e: Exception) -> str:
    return str(e) if isinstance(e, Retry) else f"{type(e).__name__}: {e}"


@contextlib.contextmanager
def _round_trip(path: str):
    """Count and time one request to etcd (metrics.py); one whose answer the caller
    did not mark usable (``answered[0] = True``) is counted as failed."""
    t0 = time.perf_counter()
    answered = [False]  # set by the caller once the answer is usable
    try:
        yield answered
    finally:
        metrics.ETCD_REQUESTS.labels(path).inc()
        metrics.ETCD_SECONDS.labels(path).observe(time.perf_counter() - t0)
        if not answered[0]:
            metrics.ETCD_FAILURES.labels(path).inc()


def answer_json(ep: str, resp: httpx.Response) -> dict:
    """The JSON of a gateway answer (ValueError if it is none)."""
    if resp.status_code == 400 and b"HTTPS server" in resp.content[:200]:
        raise Access(f"etcd {ep} speaks https: give cacert= (and cert=, key= if it "
                     "checks client certificates) in the etcd URL")
    return resp.json()



class Gateway:
    """Requests to an etcd cluster's members through their JSON gateway (a part of
    EtcdKV)."""

    def __init__(self, access: EtcdAccess, timeout: float, request_timeout: float):
        self.access = access
        self.endpoints = list(access.endpoints)
        self.timeout = timeout
        self.request_timeout = request_timeout
        self._cur = 0  # index of the endpoint in use
        self._inflight: list[set[trio.CancelScope]] = [set() for _ in self.endpoints]
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=request_timeout),
                                         verify=access.tls or True)
        self._grpc = GrpcApi(access) if access.api == "grpc" and GrpcApi is not None else None
        self._token: str | None = None  # etcd's auth token (with a user in the URL)
        self._auth_lock = trio.Lock()
        self.authentications = 0  # statistics: tokens obtained
        self.failovers = 0  # statistics: moves to the next endpoint

    async def _call(self, path: str, body: dict, timeout: float | None = None) -> dict:
        """POST ``body`` to ``path``, failing over between endpoints; the decoded answer.

        Requests whose outcome is unknown are sent again, so every mutation sent here
        must be idempotent (commits are, through their request id).

        Raises:
            Unavailable: no endpoint answered within ``timeout`` (default ``self.timeout``).
            NotFound: etcd does not know a lease named in the request.
            IOFailure: etcd rejected the request (e.g. too many operations in a txn).
        """
        deadline = trio.current_time() + (timeout or self.timeout)
        errors: dict[str, str] = {}
        attempt = 0
        reauthenticated = False
        # (authentication itself is sent without a token)
        send_token = path != "/v3/auth/authenticate"
        while True:
            i = self._cur
            ep = self.endpoints[i]
            wait = max(0.05, min(self.request_timeout, deadline - trio.current_time()))
            err = "no answer in time (or the endpoint failed another request)"
            token = self._token if send_token else None
            expired = False
            with trio.move_on_after(wait) as scope, _round_trip(path) as answered:
                self._inflight[i].add(scope)
                try:
                    status, data = await self._post(ep, path, body, token, wait)
                    out = self._check(ep + path, status, data)
                    answered[0] = True
                    return out
                except Expired as e:
                    expired, err = True, error_text(e)
                except (httpx.HTTPError, ValueError, Retry) as e:
                    self._refused_tls(ep, e)
                    err = error_text(e)
                finally:
                    self._inflight[i].discard(scope)
            if expired and not reauthenticated:  # a token that worked before: a new one
                reauthenticated = True           # (a new one refused: the member lags)
                await self._authenticate(token, max(0.05, deadline - trio.current_time()))
                continue
            errors[ep] = err
            await self._failover(i, attempt, deadline, errors)
            attempt += 1

    async def _post(self, ep: str, path: str, body: dict, token: str | None,
                    timeout: float) -> tuple[int, dict]:
        """One request to ``ep``: over gRPC if it is one etcd_grpc.py sends, else through
        the gateway; the HTTP status and the JSON answer."""
        if self._grpc is not None and path in GRPC_METHODS:
            return await self._grpc.call(ep, path, body, token, timeout)
        resp = await self._client.post(ep + path, json=body, headers=self._headers(token))
        return resp.status_code, answer_json(ep, resp)

    async def _close_transport(self) -> None:
        await self._client.aclose()
        if self._grpc is not None:
            self._grpc.close()

    def _headers(self, token: str | None) -> dict | None:
        return {"Authorization": token} if token else None

    def _check(self, where: str, status: int, data: dict) -> dict:
        """The payload of a gateway answer, or the error it carries raised."""
        data = data.get("result", data)  # streaming calls (watch, keepalive) wrap answers
        error = data.get("error")
        if status == 200 and not error:
            return data
        if isinstance(error, dict):  # error inside a stream
            code, msg = error.get("grpc_code"), error.get("message")
        else:
            code, msg = data.get("code"), data.get("message") or error
        msg = str(msg)
        if token_expired(msg):
            raise Expired(f"HTTP {status}: {msg}")
        refused = refusal(msg, self.access)
        if refused is not None:
            raise refused
        if "database space exceeded" in msg:  # (gRPC ResourceExhausted: not to retry)
            raise NoSpace(f"etcd {where}: {msg} (its NOSPACE alarm is raised: the mount "
                          "that leads the upkeep compacts, defragments and disarms it; "
                          "docs/etcd.md, History)")
        too_big = _too_big(msg)
        if (status >= 500 or status == 429 or code in _RETRY_CODES) and not too_big:
            raise Retry(f"HTTP {status}: {msg}")
        if code == 5:
            raise NotFound(f"etcd: {msg}")
        raise IOFailure(f"etcd {where}: {msg}{too_big}")

    def _refused_tls(self, ep: str, e: Exception) -> None:
        """Raise Access if ``e`` is a refusal of certificates: settings to fix, which
        no other endpoint or later try would accept."""
        why = tls_refusal(e)
        if why:
            hint = ("cacert=, cert= and key= in the etcd URL" if self.access.tls is not None
                    else "the etcd URL: it names no cacert=, so bmfs speaks plain http")
            raise Access(f"etcd {ep}: TLS refused: {why} (check {hint})") from None

    async def _authenticate(self, stale: str | None, timeout: float | None = None) -> None:
        """Trade the URL's user and password for a new token, unless another task has
        already replaced ``stale``.

        Raises:
            Access: etcd refused the user or password, or the password file is unreadable.
            Unavailable: no quorum within the timeout.
        """
        async with self._auth_lock:
            if self._token != stale:
                return
            body = {"name": self.access.user, "password": self.access.password()}
            try:
                data = await self._call("/v3/auth/authenticate", body, timeout)
            except IOFailure as e:
                if "authentication is not enabled" not in str(e):
                    raise
                log.warning("etcd has authentication off: the URL's user %r is not used "
                            "(anyone who reaches its members can read and write the "
                            "metadata; docs/etcd.md)", self.access.user)
                return
            self._token = data.get("token") or None
            self.authentications += 1

    async def _failover(self, i: int, attempt: int, deadline: float, errors: dict) -> None:
        """Move past failed endpoint ``i``; back off after a full round.

        The first task to see ``i`` fail also abandons the other requests in flight there
        (after a leader dies, proposals waiting on a follower would hang until etcd's
        7 s request timeout); they are retried on the next endpoint.

        Raises:
            Unavailable: the deadline has passed.
        """
        if self._cur == i:  # other tasks may have moved on already
            self._cur = (i + 1) % len(self.endpoints)
            self.failovers += 1
            for scope in self._inflight[i]:
                scope.cancel()
        n = len(self.endpoints)
        delay = 0.0 if (attempt + 1) % n else min(0.05 * 2 ** (attempt // n), 1.0)
        if trio.current_time() + delay >= deadline:
            raise Unavailable(f"etcd cluster unavailable ({', '.join(self.endpoints)}); "
                              "last errors: " + "; ".join(f"{ep}: {e}" for ep, e in errors.items()))
        await trio.sleep(delay)

    # -- the members' maintenance (bmfs/kv/etcd_compact.py) ----------------------------
    async def compact(self, revision: int) -> bool:
        """Drop the history before ``revision`` (etcd keeps every key's value as of it),
        and wait until its pages are free (so that a defragmentation after it frees
        them). False if it was compacted that far already.

        Raises:
            Unavailable: no quorum within the timeout.
        """
        try:
            await self._call("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        except IOFailure as e:
            if "compacted" not in str(e):
                raise
            return False
        return True

    async def alarms(self) -> list[dict]:
        """etcd's raised alarms: ``{"memberID": ..., "alarm": "NOSPACE"}`` each."""
        return (await self._call("/v3/maintenance/alarm", {"action": "GET"})).get("alarms", [])

    async def disarm(self, alarms: list[dict]) -> None:
        for a in alarms:
            await self._call("/v3/maintenance/alarm", {"action": "DEACTIVATE", **a})

    async def members_status(self) -> dict[str, dict | None]:
        """Each endpoint's status (database sizes, leader), None where it does not answer."""
        out: dict[str, dict | None] = {}
        for ep in self.endpoints:
            try:
                out[ep] = await self._call_at(ep, "/v3/maintenance/status", {})
            except (Unavailable, IOFailure):
                out[ep] = None
        return out

    async def defragment(self, ep: str) -> None:
        """Have the member at ``ep`` rewrite its database file without free pages (it
        answers nothing else meanwhile)."""
        await self._call_at(ep, "/v3/maintenance/defragment", {}, timeout=max(60, self.timeout))

    async def _call_at(self, ep: str, path: str, body: dict, timeout: float | None = None):
        """One request to the member at ``ep`` (no failover), with the token.

        Raises:
            Unavailable: it did not answer in ``timeout`` (default request_timeout).
            IOFailure, Access: it refused the request.
        """
        for again in (False, True):
            token = self._token
            try:
                with trio.fail_after(timeout or self.request_timeout), \
                        _round_trip(path) as answered:
                    status, data = await self._post(ep, path, body, token,
                                                    timeout or self.request_timeout)
                    out = self._check(ep + path, status, data)
                    answered[0] = True
                    return out
            except Expired:
                if again:
                    raise Unavailable(f"etcd {ep}: the token is not taken") from None
                await self._authenticate(token)
            except (httpx.HTTPError, ValueError, Retry, trio.TooSlowError) as e:
                raise Unavailable(f"etcd {ep}{path}: {error_text(e)}") from None
