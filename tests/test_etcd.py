"""The etcd control store (:mod:`ftrun.control.etcd`) against a real 3-member etcd cluster on this host
(:mod:`tests.etcd_cluster`, one per module): the same semantics as the c10d store, compare-and-set races, the
signed wrapper, big reads, a leader killed under load, quorum loss and recovery, and connection errors."""

from __future__ import annotations

import http.server
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import requests
from etcd3gw.exceptions import ConnectionTimeoutError
from torch.distributed import DistError

from etcd_cluster import EtcdCluster, EtcdUnavailable
from ftrun.control.etcd import MAX_TXN_OPS, OUTAGE_NOTICE, REQUEST_TIMEOUT, EtcdStore, connect_etcd
from ftrun.control.signed import SignedStore
from ftrun.control.store import C10dStore, Store, host_store
from ftrun.errors import UsageError


@pytest.fixture
def store(etcd: EtcdCluster) -> Iterator[EtcdStore]:
    connected = connect_etcd(etcd.endpoints, timeout=10)
    yield connected
    connected.close()


@pytest.fixture
def prefix() -> str:
    return f"t/{uuid.uuid4().hex[:8]}/"


@pytest.fixture(params=["c10d", "etcd"])
def any_store(request: pytest.FixtureRequest) -> Store:
    if request.param == "c10d":
        return C10dStore(host_store(0))
    return request.getfixturevalue("store")


@pytest.mark.timeout(30)
def test_semantics_match_the_c10d_store(any_store: Store, prefix: str) -> None:
    s, a, b, c = any_store, prefix + "a", prefix + "b", prefix + "c"
    assert s.get_many([]) == [] and s.check([])
    assert s.get_many([a, b]) == [None, None] and not s.check([a])
    s.set(a, b"1")
    assert s.get_many([a, b]) == [b"1", None] and s.check([a]) and not s.check([a, b])
    s.set(a, b"\x00\xff binary")
    s.set(b, b"")  # an empty value is set
    assert s.get_many([b, a]) == [b"", b"\x00\xff binary"] and s.check([a, b])
    assert s.compare_set(c, b"", b"x") == b"x"  # b"": not set -> stored
    assert s.compare_set(c, b"", b"y") == b"x"  # set now: not stored, the current value
    assert s.compare_set(c, b"x", b"z") == b"z"
    assert s.compare_set(c, b"wrong", b"w") == b"z"
    assert s.compare_set(b, b"", b"v") == b"v"  # b"" also matches a key holding b""
    assert s.get_many([c, b]) == [b"z", b"v"]
    s.set(prefix + "ü/ключ", "ä".encode())
    assert s.get_many([prefix + "ü/ключ"]) == ["ä".encode()]
    s.close()


@pytest.mark.timeout(30)
def test_compare_set_on_a_missing_key_with_a_wrong_expectation_says_it_is_missing(store: EtcdStore,
                                                                                   prefix: str) -> None:
    # c10d answers with the expected bytes here (as if the key held them); etcd says what it holds: nothing.
    assert store.compare_set(prefix + "m", b"expected", b"v") == b""
    assert store.get_many([prefix + "m"]) == [None]


@pytest.mark.timeout(30)
def test_compare_set_race_has_one_winner(etcd: EtcdCluster, prefix: str) -> None:
    stores = [connect_etcd(etcd.endpoints, timeout=10) for _ in range(12)]
    results: list[bytes] = [b""] * len(stores)
    barrier = threading.Barrier(len(stores))

    def race(i: int) -> None:
        barrier.wait()
        results[i] = stores[i].compare_set(prefix + "gen", b"", f"writer {i}".encode())

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [i for i, got in enumerate(results) if got == f"writer {i}".encode()]
    assert len(winners) == 1 and set(results) == {f"writer {winners[0]}".encode()}
    assert stores[0].get_many([prefix + "gen"]) == [results[0]]
    for s in stores:
        s.close()


@pytest.mark.timeout(30)
def test_compare_set_retried_after_a_lost_answer_still_wins(store: EtcdStore, prefix: str) -> None:
    """The txn goes through but its answer is lost: the retry finds the key holding our value and says so."""
    lost = []
    for client in store.clients:
        real = client.transaction

        def once_lost(txn, real=real):  # type: ignore[no-untyped-def]
            answer = real(txn)
            if not lost:
                lost.append(txn)
                raise ConnectionTimeoutError("read timed out (simulated)")
            return answer
        client.transaction = once_lost  # type: ignore[method-assign]
    assert store.compare_set(prefix + "claim", b"", b"mine") == b"mine" and lost
    assert store.compare_set(prefix + "claim", b"", b"other") == b"mine"


@pytest.mark.timeout(30)
def test_signed_store_over_etcd_round_trips(store: EtcdStore, prefix: str) -> None:
    warnings: list[str] = []
    signed = SignedStore(store, "job secret", warn=warnings.append)
    signed.set(prefix + "a", "payload")
    assert signed.get(prefix + "a") == b"payload"
    assert signed.multi_get([prefix + "a", prefix + "missing"]) == [b"payload", None]
    won, now = signed.compare_set(prefix + "gen", b"", b"g1")
    assert won and signed.compare_set(prefix + "gen", b"", b"g2") == (False, now)
    store.set(prefix + "forged", b"not signed")
    assert signed.get(prefix + "forged") is None and len(warnings) == 1 and prefix + "forged" in warnings[0]


@pytest.mark.timeout(30)
def test_get_many_beyond_one_txn(store: EtcdStore, prefix: str) -> None:
    keys = [f"{prefix}{i}" for i in range(2 * MAX_TXN_OPS + 44)]
    for key in keys[::5]:
        store.set(key, key.encode())
    assert store.get_many(keys) == [key.encode() if i % 5 == 0 else None for i, key in enumerate(keys)]
    assert store.check(keys[::5]) and not store.check(keys)


@pytest.mark.timeout(40)
def test_leader_killed_under_load_is_transparent(etcd: EtcdCluster, prefix: str) -> None:
    old = etcd.wait_leader()
    order = [old] + [i for i in range(len(etcd.procs)) if i != old]  # the store starts on the leader
    outages: list[str] = []
    store = connect_etcd(",".join(etcd.endpoint(i) for i in order), timeout=30, on_outage=outages.append)
    acknowledged: list[int] = []
    pauses: list[float] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        try:
            i = 0
            while not stop.is_set():
                start = time.monotonic()
                store.set(f"{prefix}{i}", str(i).encode())
                acknowledged.append(i)
                assert store.get_many([f"{prefix}{i}"]) == [str(i).encode()]
                pauses.append(time.monotonic() - start)
                i += 1
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    thread = threading.Thread(target=writer)
    thread.start()
    time.sleep(0.5)
    etcd.kill(old)
    new = etcd.wait_leader(timeout=10)
    written = len(acknowledged)
    deadline = time.monotonic() + 10
    while len(acknowledged) < written + 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    thread.join(timeout=15)
    assert not errors and not thread.is_alive() and new != old
    values = store.get_many([f"{prefix}{i}" for i in acknowledged])
    assert values == [str(i).encode() for i in acknowledged]  # no acknowledged write lost
    assert len(acknowledged) > written + 10 and max(pauses) < REQUEST_TIMEOUT + 2.5, max(pauses)
    store.close()
    print(f"leader m{old} killed: longest pause {max(pauses):.2f}s, {len(acknowledged)} writes, outages {outages}")


@pytest.mark.timeout(40)
def test_quorum_loss_blocks_then_recovers(etcd: EtcdCluster, prefix: str) -> None:
    outages: list[str] = []
    recoveries: list[float] = []
    store = connect_etcd(etcd.endpoints, timeout=30, on_outage=outages.append, on_recovered=recoveries.append)
    store.set(prefix + "before", b"1")
    etcd.kill(1)
    etcd.kill(2)
    done: list[bytes] = []
    thread = threading.Thread(target=lambda: done.append(store.compare_set(prefix + "gen", b"", b"g1")))
    thread.start()
    deadline = time.monotonic() + 3 * REQUEST_TIMEOUT + 2
    while not outages and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(outages) == 1 and thread.is_alive() and not done
    assert "etcd control store unreachable" in outages[0] and "30s" in outages[0] and "\n" not in outages[0]
    time.sleep(1.0)  # still blocked, still one outage call
    assert len(outages) == 1 and thread.is_alive() and not recoveries
    etcd.start(1)
    thread.join(timeout=20)
    assert done == [b"g1"] and len(outages) == 1 and len(recoveries) == 1 and recoveries[0] > 1.0
    assert store.get_many([prefix + "before", prefix + "gen"]) == [b"1", b"g1"]
    store.close()
    print(f"outage: {outages[0]}; recovered after {recoveries[0]:.1f}s")


@pytest.mark.timeout(30)
def test_outage_longer_than_the_timeout_raises_dist_error(etcd: EtcdCluster, prefix: str) -> None:
    outages: list[str] = []
    timeout = OUTAGE_NOTICE + 0.5  # reported first, then lost
    store = connect_etcd(etcd.endpoints, timeout=timeout, on_outage=outages.append)
    etcd.kill(0)
    etcd.kill(1)
    start = time.monotonic()
    with pytest.raises(DistError, match="etcd control store lost: no endpoint of .* answered for") as raised:
        store.get_many([prefix + "x"])
    assert timeout <= time.monotonic() - start < timeout + REQUEST_TIMEOUT + 1 and len(outages) == 1
    assert "\n" not in str(raised.value)
    with pytest.raises(DistError):  # lost for good: the next call fails at once
        store.set(prefix + "x", b"1")
    with pytest.raises(UsageError, match=r"unreachable after 0.3s \(.*etcdserver: no leader"):
        connect_etcd(etcd.endpoints, timeout=0.3)  # a cluster without quorum is not ready to start a job on
    store.close()
    print(raised.value)


def _auth_call(cluster: EtcdCluster, path: str, body: dict[str, str], token: str | None = None) -> dict:
    """POST ``body`` to the single member's gateway at ``/v3/auth/{path}`` (with ``token``); its JSON answer."""
    answer = requests.post(f"http://{cluster.endpoint(0)}/v3/auth/{path}", json=body, timeout=5,
                           headers={"Authorization": token} if token else {})
    assert answer.ok, answer.text
    return answer.json()


@pytest.mark.timeout(30)
def test_user_password_authentication(prefix: str) -> None:
    """A cluster of its own (auth is cluster-wide and sticky): credentials before and after auth is enabled, a
    wrong password, none, tokens invalidated under the store (renewed transparently), a password changed."""
    password = "s3cret-pw"
    conf = {"user": "root", "password": password}
    try:
        cluster = EtcdCluster(members=1)
    except EtcdUnavailable as err:
        pytest.skip(f"no etcd: {err}")
    try:
        try:
            cluster.start()
        except EtcdUnavailable as err:
            pytest.skip(f"cannot start a local etcd cluster: {err}")
        early = connect_etcd(cluster.endpoints, timeout=10, conf=conf)  # auth not enabled yet: no token needed
        early.set(prefix + "early", b"1")
        assert "Authorization" not in early.clients[0].session.headers

        _auth_call(cluster, "user/add", {"name": "root", "password": password})
        _auth_call(cluster, "user/grant", {"user": "root", "role": "root"})
        _auth_call(cluster, "enable", {})
        assert early.get_many([prefix + "early"]) == [b"1"]  # "user name is empty": authenticates now

        store = connect_etcd(cluster.endpoints, timeout=10, conf=conf)
        store.set(prefix + "a", b"1")
        assert store.get_many([prefix + "a", prefix + "b", prefix + "early"]) == [b"1", None, b"1"]
        assert store.compare_set(prefix + "gen", b"", b"g1") == b"g1"
        assert store.compare_set(prefix + "gen", b"", b"g2") == b"g1"

        with pytest.raises(UsageError, match=rf"^etcd endpoint {cluster.endpoint(0)}: authentication failed for "
                                             r"user 'root' \(etcdserver: authentication failed") as raised:
            connect_etcd(cluster.endpoints, timeout=10, conf={"user": "root", "password": "wrong-pw"})
        assert "wrong-pw" not in str(raised.value) and "\n" not in str(raised.value)
        with pytest.raises(UsageError, match=rf"^etcd endpoint {cluster.endpoint(0)} requires authentication "
                                             r"\(etcdserver: user name is empty\); give --rdzv-conf user="):
            connect_etcd(cluster.endpoints, timeout=10)

        # every token invalidated (disable drops them): the store's next requests get new ones, transparently
        old_token = store.clients[0].session.headers["Authorization"]
        root = _auth_call(cluster, "authenticate", {"name": "root", "password": password})["token"]
        _auth_call(cluster, "disable", {}, token=root)
        _auth_call(cluster, "enable", {})
        assert store.compare_set(prefix + "gen", b"g1", b"g3") == b"g3"
        assert store.clients[0].session.headers["Authorization"] != old_token
        assert early.get_many([prefix + "gen"]) == [b"g3"]

        # the password changed and the tokens invalidated: renewing fails, a DistError without either password
        root = _auth_call(cluster, "authenticate", {"name": "root", "password": password})["token"]
        _auth_call(cluster, "user/changepw", {"name": "root", "password": "new-pw"}, token=root)
        root = _auth_call(cluster, "authenticate", {"name": "root", "password": "new-pw"})["token"]
        _auth_call(cluster, "disable", {}, token=root)
        _auth_call(cluster, "enable", {})
        with pytest.raises(DistError, match=r"refused a request \(authentication failed for user 'root'\)") as lost:
            store.get_many([prefix + "a"])
        assert password not in str(lost.value) and "new-pw" not in str(lost.value)
        for connected in (early, store):
            connected.close()
    finally:
        cluster.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.timeout(30)
def test_connect_to_nothing_is_a_usage_error_after_the_timeout() -> None:
    port = _free_port()
    start = time.monotonic()
    with pytest.raises(UsageError, match=rf"etcd endpoint\(s\) 127.0.0.1:{port} unreachable after 0.5s "
                                         r"\(.*Connection refused"):
        connect_etcd(f"127.0.0.1:{port}", timeout=0.5)
    assert 0.5 <= time.monotonic() - start < 3


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(params=["http", "tcp"])
def not_etcd(request: pytest.FixtureRequest) -> Iterator[str]:
    """A plain HTTP server, or a TCP server that answers garbage, on a free port: its host:port."""
    if request.param == "http":
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield f"127.0.0.1:{server.server_address[1]}"
        server.shutdown()
        server.server_close()
        return
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"-ERR unknown command\r\n")

    threading.Thread(target=serve, daemon=True).start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


@pytest.mark.timeout(30)
def test_connect_to_something_else_names_it(etcd: EtcdCluster, not_etcd: str) -> None:
    with pytest.raises(UsageError, match=rf"^{not_etcd} is not an etcd v3 endpoint: "):
        connect_etcd(not_etcd, timeout=5)
    with pytest.raises(UsageError, match=rf"^{not_etcd} is not an etcd v3 endpoint: "):
        connect_etcd(f"{etcd.endpoints},{not_etcd}", timeout=5)


@pytest.mark.parametrize(("endpoints", "conf", "message"), [
    ("127.0.0.1:2379", {"colour": "blue"}, "unknown --rdzv-conf key 'colour' for etcd"),
    ("127.0.0.1:2379", {"user": "root"}, "user=... and password=... go together"),
    ("127.0.0.1:2379", {"password": "hunter2"}, "user=... and password=... go together"),
    ("127.0.0.1:2379", {"user": "", "password": "hunter2"}, "user= is empty"),
    ("127.0.0.1:2379", {"protocol": "ftp"}, "protocol=ftp: expected http or https"),
    ("https://127.0.0.1:2379", {"protocol": "http"}, "protocol=http: expected http or https"),
    ("127.0.0.1:2379", {"cert": "/nonexistent.pem", "key": "/nonexistent.key"}, "cert=/nonexistent.pem: no such"),
    ("127.0.0.1:2379,host:port", None, "bad etcd endpoint 'host:port'"),
    ("127.0.0.1:99999", None, "bad etcd endpoint '127.0.0.1:99999'"),
    ("127.0.0.1:2379,,", None, "bad etcd endpoint ''"),
    ("http://a:1,https://b:1", None, "mix schemes"),
])
@pytest.mark.timeout(10)
def test_bad_endpoints_and_conf_are_usage_errors(endpoints: str, conf: dict[str, str] | None, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(".", r"\.")) as raised:
        connect_etcd(endpoints, timeout=0.1, conf=conf)
    assert "hunter2" not in str(raised.value)
