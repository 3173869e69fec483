"""etcd v3 as the control store: :class:`EtcdStore` implements :class:`~ftrun.control.store.Store`.

Client. `etcd3gw <https://opendev.org/openstack/etcd3gw>`_ (maintained by OpenStack) talks to the JSON gateway
that every etcd >= 3.4 serves under ``/v3/`` on its client port, over plain HTTP(S) with ``requests``: no grpc or
protobuf wheels whose versions would have to agree with torch's. A secured cluster is reached with TLS client
certificates (``cert``/``key``, etcd's ``--client-cert-auth``) and/or etcd's user/password authentication
(``user``/``password``, see below).
Keys go out as UTF-8, values as raw bytes (both base64 in the JSON). The environment's proxy and CA bundle
variables are ignored (requests would let ``REQUESTS_CA_BUNDLE`` override ``cacert``): etcd is reached directly.

Mapping, one HTTP request per call:

- ``set``: ``kv/put``.
- ``get_many``: ``kv/txn`` with no compare and one range per key; at most :data:`MAX_TXN_OPS` (etcd's default
  ``--max-txn-ops``) per txn, so more keys take several txns, each consistent on its own. ``check`` is get_many.
- ``compare_set``: ``kv/txn``: if the key holds ``expected`` then put ``value`` else range it; the answer is
  ``value`` when the put happened, else what the key holds (b"" when it is not set). ``expected`` b"" matches a
  key that does not exist (create_revision 0) or holds b"" (a nested txn), as the c10d store does.

Reads are linearizable (etcd's default: no ``serializable`` flag), so a read sees every acknowledged write.

Authentication. etcd3gw has none, so ftrun does it: with ``user`` and ``password`` each endpoint's client posts
them to ``auth/authenticate`` (without a token: etcd refuses even that request when it carries a stale one) and
sends the token it gets as the ``Authorization`` header of its later requests. A token that etcd no longer takes
(401, gRPC code 16 "etcdserver: invalid auth token": a simple token unused for ``--auth-token-ttl``, 300 s by
default, or auth disabled and enabled again; 400, code 3 "revision of auth store is old" or "user name is empty":
users or roles changed, auth enabled after ftrun connected) is replaced by a new one and the request retried once,
on the same endpoint. connect_etcd authenticates with every endpoint that answers, so a wrong user or password
(400, code 3 "etcdserver: authentication failed, invalid user ID or password") is a :class:`UsageError` at once;
without credentials it reads one key (serializable, so the leader is not asked) to find a cluster that requires
them (400, code 3 "etcdserver: user name is empty"), also a UsageError. A cluster without auth enabled answers
authenticate with 412, code 9 "authentication is not enabled": the requests then go without a token. The password
is kept by the store for renewals and never appears in an error or log line.

Failures. There is one client per endpoint. Calls go to the current one; a connection error, a timeout
(:data:`REQUEST_TIMEOUT`, so a dead or isolated member is skipped quickly) or an error answer (503 "etcdserver: no
leader" / "leader changed" / "request timed out", 500 "context deadline exceeded") moves on to the next endpoint,
and after a whole round of failures the next round starts :data:`RETRY_INTERVAL` later. Requests carry etcd's
"require leader" metadata, so a member that knows it has no leader (an election, a lost quorum) says so at once
instead of holding the request for etcd's own timeout (5 s and more). Retrying is safe: a put is idempotent, and
a compare_set whose put went through but whose answer was lost finds the key holding its own value on the retry
and returns it, so the caller still sees that it won. A leader change with a quorum alive costs a pause of about
the election (up to :data:`REQUEST_TIMEOUT` more when a follower forwarded the request to the dead leader).

Outages. When no endpoint has answered for :data:`OUTAGE_NOTICE` seconds, ``on_outage`` is called once with one
line (the endpoints, the last error, how long ftrun waits), and ``on_recovered(seconds)`` once a request succeeds
again. A request that fails when no endpoint has answered for ``timeout`` seconds raises
``torch.distributed.DistError`` (callers: "control store lost"); so do errors no retry fixes (permission denied,
authentication failed after a renewal).
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import ConnectionTimeoutError, Etcd3Exception
from torch.distributed import DistError
from urllib3.exceptions import ProtocolError

from ftrun.control.spec import ETCD_PORT as DEFAULT_PORT
from ftrun.errors import UsageError

CONF_KEYS = ("protocol", "cacert", "cert", "key", "user", "password")  # the --rdzv-conf keys for etcd
API_PATH = "/v3/"  # etcd >= 3.4 (3.3 served /v3beta/)
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
POLL_INTERVAL = 0.1  # callers poll etcd at most this often (a read costs ~0.7 ms of CPU here, and the leader's)
REQUEST_TIMEOUT = 1.0  # seconds per HTTP request before the next endpoint is tried
RETRY_INTERVAL = 0.15  # seconds between rounds over the endpoints while none answers
OUTAGE_NOTICE = 2.0  # seconds without any answer before on_outage is called (leader elections stay silent)
REQUIRE_LEADER_HEADER = "Grpc-Metadata-hasleader"  # the gateway passes it on as etcd's "hasleader" gRPC metadata
PROBE_INTERVAL = 0.2  # seconds between rounds of connect_etcd's probe
FATAL_GRPC_CODES = {3: "invalid argument", 7: "permission denied", 16: "unauthenticated"}  # no retry fixes these
AUTH_HEADER = "Authorization"  # the gateway passes it on as etcd's "authorization" gRPC metadata: the token
# etcd's answers to a token it does not take (any more): get a new one and retry once (what etcd's clientv3 does)
TOKEN_REJECTED = ("invalid auth token", "revision of auth store is old", "user name is empty")
AUTH_FAILED = "authentication failed"  # etcd's answer to a wrong user or password (gRPC code 3)
AUTH_NOT_ENABLED = 9  # gRPC code (FailedPrecondition, HTTP 412) of "etcdserver: authentication is not enabled"

T = TypeVar("T")
Endpoint = tuple[str, int]


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _value(range_response: dict[str, Any]) -> bytes | None:
    """The value in a range response of one key (the gateway leaves out empty fields), None when not set."""
    kvs = range_response.get("kvs")
    return base64.b64decode(kvs[0].get("value", "")) if kvs else None


def _etcd_error(err: BaseException) -> dict[str, Any] | None:
    """The JSON of an error answer of etcd's gateway (``{"error": text, "code": gRPC code}``), else None."""
    try:
        body = json.loads(getattr(err, "detail_text", None) or "")
    except ValueError:
        return None
    return body if isinstance(body, dict) and "error" in body else None


def _reason(err: BaseException) -> str:
    """One short line for a failed request: etcd's error text, the OS error, or what the HTTP answer was."""
    detail, body = getattr(err, "detail_text", None) or "", _etcd_error(err)
    if body:
        return str(body["error"])
    if isinstance(err, (ConnectionTimeoutError, requests.Timeout)):
        connected = isinstance(err.__context__ or err, requests.ReadTimeout)
        return f"{'connected, but ' if connected else ''}no answer within {REQUEST_TIMEOUT:g}s"
    found = re.search(r"\[(?:Errno -?\d+|SSL: [A-Z_]+)\] ([^'\")(]+)|Error\(\d+, '([^'(]+)", detail or str(err))
    if found:
        return (found.group(1) or found.group(2)).strip()
    text = " ".join(f"{detail} {' '.join(map(str, err.args))}".split())
    return text[:160] or type(err).__name__


def _auth_error(err: BaseException, phrases: Sequence[str]) -> bool:
    """Whether ``err`` is an error answer of etcd whose text has one of ``phrases``."""
    text = str((_etcd_error(err) or {}).get("error", ""))
    return any(phrase in text for phrase in phrases)


class EtcdStore:
    """:class:`~ftrun.control.store.Store` over an etcd v3 cluster; see the module doc. Thread-safe."""

    poll_interval = POLL_INTERVAL

    def __init__(self, endpoints: Sequence[Endpoint], timeout: float, *, protocol: str = "http",
                 cacert: str | None = None, cert: str | None = None, key: str | None = None,
                 user: str | None = None, password: str | None = None,
                 on_outage: Callable[[str], None] | None = None,
                 on_recovered: Callable[[float], None] | None = None) -> None:
        self.endpoints = [f"{host}:{port}" for host, port in endpoints]
        self.op_timeout = timeout
        self.clients = [Etcd3Client(host, port, protocol=protocol, ca_cert=cacert, cert_key=key, cert_cert=cert,
                                    timeout=REQUEST_TIMEOUT, api_path=API_PATH) for host, port in endpoints]
        for client in self.clients:
            client.session.headers[REQUIRE_LEADER_HEADER] = "true"  # no leader: answer at once instead of hanging
            client.session.trust_env = False  # else REQUESTS_CA_BUNDLE & co. override cacert, *_PROXY apply
        self.user = user
        self._password = password  # for renewals; never in a message
        self._authenticated = [user is None] * len(self.clients)  # the client has a token (or needs none)
        self._on_outage, self._on_recovered = on_outage, on_recovered
        self._lock = threading.Lock()
        self._current = 0
        self._down_since: float | None = None  # first failure since the last success
        self._reported = False  # on_outage was called for this outage

    # -- the Store interface --------------------------------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        self._call(lambda client: client.put(key.encode(), bytes(value)))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        keys = list(keys)
        values: list[bytes | None] = []
        for start in range(0, len(keys), MAX_TXN_OPS):
            ops = [{"request_range": {"key": _b64(key)}} for key in keys[start:start + MAX_TXN_OPS]]
            answer = self._txn({"compare": [], "success": ops, "failure": []})
            values += [_value(op["response_range"]) for op in answer.get("responses", [])]
        return values

    def compare_set(self, key: str, expected: bytes, value: bytes) -> bytes:
        name, put = _b64(key), {"request_put": {"key": _b64(key), "value": _b64(value)}}
        read = {"request_range": {"key": name}}
        same = {"key": name, "result": "EQUAL", "target": "VALUE", "value": _b64(expected)}
        if expected:
            answer = self._txn({"compare": [same], "success": [put], "failure": [read]})
        else:  # missing (a value compare on a missing key fails) or present and empty
            missing = {"key": name, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
            empty = {"request_txn": {"compare": [same], "success": [put], "failure": [read]}}
            answer = self._txn({"compare": [missing], "success": [put], "failure": [empty]})
            if not answer.get("succeeded"):
                answer = answer["responses"][0]["response_txn"]
        if answer.get("succeeded"):
            return bytes(value)
        return _value(answer["responses"][0]["response_range"]) or b""

    def check(self, keys: Sequence[str]) -> bool:
        return all(value is not None for value in self.get_many(keys))

    def close(self) -> None:
        for client in self.clients:
            client.session.close()

    # -- authentication -------------------------------------------------------------------------------------
    def _authenticate(self, index: int) -> None:
        """A new token for client ``index`` (its Authorization header; none when the cluster has auth disabled).
        Raises what the request raises: Etcd3Exception (a wrong user or password: code 3 "authentication failed")
        or requests' errors; the message never holds the password."""
        client = self.clients[index]
        try:  # no token: etcd refuses authenticate itself when it carries a stale one (401 invalid auth token)
            answer = client.post(client.get_url("/auth/authenticate"), json={"name": self.user,
                                 "password": self._password}, headers={AUTH_HEADER: None})
        except Etcd3Exception as err:
            if (_etcd_error(err) or {}).get("code") != AUTH_NOT_ENABLED:
                raise
            client.session.headers.pop(AUTH_HEADER, None)
        else:
            client.session.headers[AUTH_HEADER] = str(answer["token"])
        self._authenticated[index] = True

    def _attempt(self, index: int, request: Callable[[Etcd3Client], T]) -> T:
        """``request`` on client ``index``, authenticated first when it has no token yet, and once more with a new
        token when etcd no longer takes the one it has (expired, invalidated)."""
        client = self.clients[index]
        if not self._authenticated[index]:
            self._authenticate(index)
        try:
            return request(client)
        except Etcd3Exception as err:
            if self.user is None or not _auth_error(err, TOKEN_REJECTED):
                raise
        self._authenticate(index)
        return request(client)

    # -- requests with failover -----------------------------------------------------------------------------
    def _txn(self, txn: dict[str, Any]) -> dict[str, Any]:
        return cast("dict[str, Any]", self._call(lambda client: client.transaction(txn)))

    def _call(self, request: Callable[[Etcd3Client], T]) -> T:
        """``request`` on the current endpoint, moving on to the next one on failure until one answers."""
        failures = 0
        while True:
            with self._lock:
                index = self._current
            started = time.monotonic()
            try:
                result = self._attempt(index, request)
            except (Etcd3Exception, requests.RequestException) as err:
                failures += 1
                self._failed(index, err, started, whole_round=failures % len(self.clients) == 0)
                continue
            if self._down_since is not None:
                with self._lock:
                    since, reported = self._down_since, self._reported
                    self._down_since, self._reported = None, False
                if since is not None and reported and self._on_recovered is not None:
                    self._on_recovered(time.monotonic() - since)
            return result

    def _failed(self, index: int, err: Exception, started: float, whole_round: bool) -> None:
        """Note a failed request (sent at ``started``) and move on to the next endpoint; after a whole round of
        failures report the outage, give up once it has lasted ``timeout``, or wait a moment."""
        reason = f"{self.endpoints[index]}: {_reason(err)}"
        code = (_etcd_error(err) or {}).get("code")
        if code in FATAL_GRPC_CODES:
            label = FATAL_GRPC_CODES[code]
            if _auth_error(err, (AUTH_FAILED, *TOKEN_REJECTED)):
                label = (f"authentication failed for user {self.user!r}" if self.user is not None else
                         "authentication required: give --rdzv-conf user=...,password=...")
            raise DistError(f"etcd control store refused a request ({label}): {reason}") from None
        now = time.monotonic()
        with self._lock:
            if self._current == index:
                self._current = (index + 1) % len(self.clients)
            if self._down_since is None:
                self._down_since = started
            down_for = now - self._down_since
            notify = whole_round and OUTAGE_NOTICE <= down_for < self.op_timeout and not self._reported
            self._reported = self._reported or notify
        if notify and self._on_outage is not None:
            self._on_outage(f"etcd control store unreachable: no endpoint of {','.join(self.endpoints)} answers "
                            f"(last error {reason}); ftrun pauses up to {self.op_timeout:g}s for it to come back")
        if down_for >= self.op_timeout:
            raise DistError(f"etcd control store lost: no endpoint of {','.join(self.endpoints)} answered for "
                            f"{down_for:.1f}s (last error {reason})")
        if whole_round:
            time.sleep(RETRY_INTERVAL)


# -- connecting ---------------------------------------------------------------------------------------------
def parse_endpoints(endpoints: str) -> tuple[list[Endpoint], str | None]:
    """``[scheme://]host[:port],...`` (port 2379 by default, IPv6 hosts in brackets) as (host, port) pairs without
    duplicates, and the scheme they name (None: none); a malformed entry is a :class:`UsageError` naming it."""
    parsed: list[Endpoint] = []
    schemes: set[str | None] = set()
    for item in endpoints.split(","):
        text = item.strip()
        found = re.fullmatch(r"(?:(https?)://)?(?:\[([0-9A-Fa-f:.]+)\]|([\w.-]+))(?::(\d{1,5}))?/?", text)
        port = int(found.group(4) or DEFAULT_PORT) if found else 0
        if not found or not 0 < port < 65536:
            raise UsageError(f"bad etcd endpoint {text!r} in {endpoints!r} (expected host:port[,host:port...])")
        schemes.add(found.group(1))
        if (endpoint := (found.group(2) or found.group(3), port)) not in parsed:
            parsed.append(endpoint)
    if len(schemes) > 1:
        raise UsageError(f"etcd endpoints {endpoints!r} mix schemes (give all or none as http:// or https://)")
    return parsed, schemes.pop()


def _credentials(conf: dict[str, str]) -> tuple[str | None, str | None]:
    """EtcdStore's user/password from ``--rdzv-conf``: both or neither (the password is never in a message)."""
    user, password = conf.get("user"), conf.get("password")
    if (user is None) != (password is None):
        raise UsageError("--rdzv-conf user=... and password=... go together (etcd's user/password authentication)")
    if user is not None and not user:
        raise UsageError("--rdzv-conf user= is empty (expected an etcd user name)")
    return user, password


def _tls_options(conf: dict[str, str], scheme: str | None) -> tuple[str, str | None, str | None, str | None]:
    """EtcdStore's protocol/cacert/cert/key from ``--rdzv-conf`` and the endpoints' scheme (default: https when a
    TLS file is given, else http)."""
    for name in [name for name in conf if name not in CONF_KEYS]:  # in the order given
        raise UsageError(f"unknown --rdzv-conf key {name!r} for etcd (known: {', '.join(CONF_KEYS)})")
    files = {name: conf.get(name) for name in ("cacert", "cert", "key")}
    for name, path in files.items():
        if path is not None and not Path(path).is_file():
            raise UsageError(f"--rdzv-conf {name}={path}: no such file")
    if (files["cert"] is None) != (files["key"] is None):
        raise UsageError("--rdzv-conf cert=... and key=... go together (the client certificate and its key)")
    protocol = conf.get("protocol", scheme or ("https" if any(files.values()) else "http"))
    if protocol not in ("http", "https") or scheme not in (None, protocol):
        raise UsageError(f"--rdzv-conf protocol={protocol}: expected http or https (as the endpoints' scheme)")
    if protocol == "http" and any(files.values()):
        raise UsageError("--rdzv-conf cacert/cert/key need protocol=https")
    return protocol, files["cacert"], files["cert"], files["key"]


def _probe(name: str, client: Etcd3Client) -> tuple[str | None, str | None]:
    """(cluster id, None) when ``client``'s endpoint answers as etcd v3; (None, why) when it does not answer
    (yet); a :class:`UsageError` when something answers that is not etcd v3."""
    try:
        status = cast("dict[str, Any]", client.status())
        return str(status["header"]["cluster_id"]), None
    except Etcd3Exception as err:
        context = err.__context__
        if isinstance(context, requests.exceptions.SSLError):
            raise UsageError(f"etcd endpoint {name}: TLS handshake failed ({_reason(err)}); check "
                             "--rdzv-conf protocol/cacert/cert/key") from None
        if isinstance(context, requests.ConnectionError) and isinstance(context.args[0], ProtocolError):
            why = f"it accepts connections but does not answer HTTP ({_reason(context.args[0])})"
            why += "; if it is a TLS endpoint, use https" if client.protocol == "http" else ""
        elif type(err) is Etcd3Exception and _etcd_error(err) is None:  # an HTTP answer that is not etcd's JSON
            why = f"it answers HTTP {' '.join(map(str, err.args))!r} to /v3/maintenance/status"
        else:  # also a read timeout: an etcd member that restarted without a quorum does not answer until it has one
            return None, _reason(err)
    except (requests.RequestException, KeyError, TypeError):  # HTTP 200 that is not etcd's JSON
        why = "its answer to /v3/maintenance/status is not etcd's"
    raise UsageError(f"{name} is not an etcd v3 endpoint: {why} (etcd >= 3.4 serves its JSON API under /v3/)")


def connect_etcd(endpoints: str, timeout: float, conf: dict[str, str] | None = None,
                 on_outage: Callable[[str], None] | None = None,
                 on_recovered: Callable[[float], None] | None = None) -> EtcdStore:
    """An :class:`EtcdStore` on ``endpoints`` (``host:port,...``) once one of them answers as etcd v3, waiting up
    to ``timeout`` seconds (also the store's outage limit); bad endpoints or ``conf`` (``--rdzv-conf``: protocol,
    cacert, cert, key, user, password), nothing answering, something that is not etcd v3 answering, a wrong user or
    password, or a cluster requiring authentication without them are :class:`UsageError`."""
    parsed, scheme = parse_endpoints(endpoints)
    protocol, cacert, cert, key = _tls_options(dict(conf or {}), scheme)
    user, password = _credentials(dict(conf or {}))
    store = EtcdStore(parsed, timeout, protocol=protocol, cacert=cacert, cert=cert, key=key, user=user,
                      password=password, on_outage=on_outage, on_recovered=on_recovered)
    try:
        return _wait_for_etcd(store, timeout)
    except BaseException:
        store.close()
        raise


def _wait_for_etcd(store: EtcdStore, timeout: float) -> EtcdStore:
    """``store`` once an endpoint answers as etcd v3 (the current one from then on); see :func:`connect_etcd`."""
    deadline = time.monotonic() + timeout
    while True:
        answers = {name: _probe(name, client) for name, client in zip(store.endpoints, store.clients)}
        clusters = {name: cluster for name, (cluster, _) in answers.items() if cluster is not None}
        if len(set(clusters.values())) > 1:
            raise UsageError(f"etcd endpoints {', '.join(clusters)} belong to different clusters "
                             f"({', '.join(f'{n}: {c}' for n, c in clusters.items())})")
        if clusters:
            store._current = store.endpoints.index(next(iter(clusters)))
            _check_access(store, list(clusters))
            return store
        if time.monotonic() >= deadline:
            reasons = "; ".join(f"{name}: {why}" for name, (_, why) in answers.items())
            raise UsageError(f"etcd endpoint(s) {','.join(store.endpoints)} unreachable after {timeout:g}s "
                             f"({reasons})")
        time.sleep(PROBE_INTERVAL)


def _check_access(store: EtcdStore, answering: Sequence[str]) -> None:
    """Authenticate with the ``answering`` endpoints (the others do when first used), or without credentials read one
    key on the current one; a wrong user or password, or a cluster that requires them, is a :class:`UsageError`.
    Any other failure is left to the requests that follow (failover)."""
    names = answering if store.user is not None else [store.endpoints[store._current]]
    for name in names:
        index = store.endpoints.index(name)
        client = store.clients[index]
        try:
            if store.user is not None:
                store._authenticate(index)
            else:
                client.post(client.get_url("/kv/range"),
                            json={"key": _b64("\0"), "serializable": True, "count_only": True})
        except (Etcd3Exception, requests.RequestException) as err:
            if store.user is not None and _auth_error(err, (AUTH_FAILED,)):
                raise UsageError(f"etcd endpoint {name}: authentication failed for user {store.user!r} "
                                 f"({_reason(err)}); check --rdzv-conf user=...,password=...") from None
            if store.user is None and _auth_error(err, ("user name is empty",)):
                raise UsageError(f"etcd endpoint {name} requires authentication ({_reason(err)}); give "
                                 "--rdzv-conf user=...,password=...") from None
