"""A running 2-node job under attack. It listens on loopback only and keeps its secret from trainers. An intruder
writes garbage, unsigned, copied and wrongly signed generation documents and garbage counters into its control
store; then 10 s of hostile traffic go to every TCP port it listens on (control store, trainer store, keepers'
peer sockets, the trainers' gloo sockets): random bytes, frames announcing oversized lengths, and well-formed
frames with random contents (TCPStore requests setting random keys, some under the job's own prefix with values
that look signed; keeper frames and handshakes with random MACs). The job must finish with the failure-free
result and no failure, and say once per process which value it ignored. Traffic is bounded in count and time and
goes to loopback only."""

from __future__ import annotations

import json
import os
import random
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import psutil
import pytest

from torch.distributed import TCPStore

from conftest import assert_job_left_nothing, gpt_args, primary_failures, restores
from ftrun.launch.handoff import SUPERVISOR_MODULE
from ftrun.launch.processes import SUPERVISOR_NAME
from ftrun.control.coordination import Generation
from ftrun.control.secret import secret_path
from ftrun.control.signed import TAG_MARK
from ftrun.control.heartbeat import HeartbeatTable
from ftrun.control.spec import ENV_SHM_DIR, shm_dir, write_shm_file
from ftrun.errors import UsageError
from ftrun.snapshot.redundancy import REJECT_LOGGED, REJECT_NOTICE
from ftrun.snapshot.slot import SlotFile
from ftrun.snapshot.transport import FRAME, FRAME_MAGIC, HELLO, MAC_LEN, NONCE_LEN

FUZZ_SECONDS = 10.0
MAX_SENDS = 6000  # connections opened in all
MAX_CHUNK = 64 << 10  # bytes sent on one connection at most
RESCAN_EVERY = 1.0  # seconds between looks for the job's listening ports (trainer stores change per generation)
# torch TCPStore's wire format (torch 2.x): a query byte, then u64 little-endian lengths before strings
STORE_VALIDATE = b"\x00" + struct.pack("<I", 0x3C85F7CE)
STORE_QUERIES = {"set": 1, "compare_set": 2, "get": 3, "add": 4, "check": 5, "multi_get": 10}


def _string(data: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(data) if length is None else length) + data


def store_frame(rng: random.Random, prefix: str) -> bytes:
    """A validated TCPStore request with random contents: a set/compare_set/add/get/check of a random key (half
    of them under the job's prefix, values half "signed"), or one that announces an oversized length."""
    key = (f"/{prefix}{rng.randbytes(6).hex()}" if rng.random() < 0.5 else "/" + rng.randbytes(8).hex()).encode()
    value = rng.randbytes(rng.randint(0, 256))
    if rng.random() < 0.5:
        value += TAG_MARK + rng.randbytes(32).hex().encode()
    kind = rng.choice(["set", "compare_set", "add", "get", "check", "oversized"])
    if kind == "set":
        body = _string(key) + _string(value)
    elif kind == "compare_set":
        body = _string(key) + _string(b"") + _string(value)
    elif kind == "add":
        body = _string(key) + struct.pack("<q", rng.randint(-1000, 1000))
    elif kind in ("get", "check"):
        body = (_string(key) if kind == "get" else struct.pack("<Q", 1) + _string(key))
    else:
        kind = rng.choice(["set", "multi_get", "check"])
        body = struct.pack("<Q", rng.choice([2**31, 2**40, 2**63, 2**64 - 1])) + rng.randbytes(64)
    return STORE_VALIDATE + bytes([STORE_QUERIES[kind]]) + body


def keeper_frame(rng: random.Random) -> bytes:
    """A keeper-transport message: a frame with random JSON before any handshake, one announcing oversized
    lengths, or a handshake answer with a random MAC (sent after the server's hello)."""
    kind = rng.choice(["frame", "oversized", "handshake"])
    if kind == "frame":
        body = json.dumps({"op": rng.choice(["status", "fetch", "persist", "echo"]), "x": rng.random()}).encode()
        return FRAME.pack(FRAME_MAGIC, len(body), 0) + body
    if kind == "oversized":
        return FRAME.pack(FRAME_MAGIC, rng.choice([2**20, 2**32 - 1]), rng.choice([2**40, 2**64 - 1]))
    return rng.randbytes(NONCE_LEN + MAC_LEN)


def job_ports(launcher: int) -> dict[int, str]:
    """port -> "store", "keeper" or "raw" for every TCP port the job's processes listen on (loopback only)."""
    procs = [psutil.Process(launcher), *psutil.Process(launcher).children(recursive=True)]
    ports: dict[int, str] = {}
    for proc in procs:
        try:
            cmdline = " ".join(proc.cmdline())
            supervisor = proc.name() == SUPERVISOR_NAME or SUPERVISOR_MODULE in cmdline  # forked, or started
            found = [c.laddr for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
        for address in found:
            assert address.ip == "127.0.0.1", (cmdline, address)
            kind = ("keeper" if "ftrun.snapshot.keeper" in cmdline else
                    "store" if proc.pid == launcher or supervisor else "raw")
            if ports.get(address.port) != "keeper":  # the supervisor holds its keeper's socket too
                ports[address.port] = kind
    return ports


def send(port: int, data: bytes, expect_hello: bool = False) -> None:
    """Connect to 127.0.0.1:``port``, (read a keeper's hello,) send ``data``, close; any error is fine."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.settimeout(0.5)
            if expect_hello:
                sock.recv(HELLO.size)
            sock.sendall(data[:MAX_CHUNK])
    except OSError:
        pass


def intrude(job, prefix: str) -> None:
    """Write what an intruder with access to the store but not the secret would: garbage, an unsigned forged
    generation, one copied from another key, one with a wrong signature; garbage beat and incarnation values."""
    endpoint = json.loads(Path(shm_dir(), f"ftrun-{job.job_id}-launcher").read_text())["endpoint"]
    host, port = endpoint.rsplit(":", 1)
    intruder = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    forged = Generation(7, "crash", "forged by a test", 1, 3, "intruder").encode().encode()
    for value in (b"\xff garbage {", forged, intruder.get(prefix + "history/0"), forged + TAG_MARK + b"0" * 64):
        intruder.set(prefix + "gen", value)
        time.sleep(0.2)
    intruder.set(prefix + "node/1/beat", b"not a number")  # torch's add on it would drop the beater's connection
    intruder.set(prefix + "node/0/owner", b"\xff")


@pytest.mark.timeout(300)
def test_job_survives_forged_control_values_and_hostile_traffic_on_every_listening_port(start_job, tmp_path,
                                                                                       gpt_baseline):
    args, out = gpt_args(tmp_path, "hostile", "--step-time", "0.35")  # 60 steps: longer than the fuzzing
    job = start_job("--nnodes", "2", "--nproc-per-node", "2", *args)
    job.wait_for_event(lambda e: e["event"] == "first_heartbeat", 120)
    prefix = f"ftrun/{job.job_id}/1/"
    # the secret is in a private file for `ftrun status`, never in a trainer's environment
    assert stat.S_IMODE(os.stat(secret_path(job.job_id)).st_mode) == 0o600
    assert all("FTRUN_JOB_SECRET" not in job.trainer(rank).environ() for rank in range(4))
    assert len(job_ports(job.proc.pid)) >= 4  # every one on loopback (job_ports checks)
    intrude(job, prefix)
    rng = random.Random(20261123)
    sent: dict[str, int] = {}
    ports: dict[int, str] = {}
    start = rescan = time.monotonic()
    while time.monotonic() - start < FUZZ_SECONDS and sum(sent.values()) < MAX_SENDS and job.proc.poll() is None:
        if not ports or time.monotonic() >= rescan:
            ports, rescan = job_ports(job.proc.pid), time.monotonic() + RESCAN_EVERY
        for port, kind in list(ports.items()):
            choice = rng.choice(["bytes", "bytes", kind])
            if choice == "store":
                send(port, store_frame(rng, prefix))
            elif choice == "keeper":
                frame = keeper_frame(rng)
                send(port, frame, expect_hello=len(frame) == NONCE_LEN + MAC_LEN)
            else:
                send(port, rng.randbytes(rng.choice([1, 16, 4096, MAX_CHUNK])))
            sent[f"{kind}/{choice}"] = sent.get(f"{kind}/{choice}", 0) + 1
        time.sleep(len(ports) * FUZZ_SECONDS / MAX_SENDS)  # spread the connections over the whole time
    fuzzed = time.monotonic() - start
    print(f"fuzzed {fuzzed:.1f}s, {len(ports)} ports, connections: {sent}")
    assert job.wait(240) == 0, job.output
    assert fuzzed >= FUZZ_SECONDS - 1, (fuzzed, sent)  # the job outlasted the fuzzing
    assert {kind.split("/")[0] for kind in sent} == {"store", "keeper", "raw"}, sent
    assert out.read_text().strip() == gpt_baseline, job.output
    assert not primary_failures(job), job.output
    rejected = [e for e in job.events() if e["event"] == "store_rejected"]
    assert any(f"{prefix}gen:" in e["message"] for e in rejected), rejected
    lines = [line for line in job.output.splitlines() if f"ignored the control-store value of {prefix}gen: " in line]
    assert lines and len(lines) == len({line.split("]")[0].split("[")[-1] for line in lines}), lines  # 1/process
    assert_job_left_nothing(job)


def hold_silent_connections(launcher: int, stop: threading.Event, per_port: int = 100) -> dict[str, int]:
    """Keep ``per_port`` silent connections (no handshake, nothing sent) open to each keeper port of the job,
    opening new ones as the keepers drop old ones, until ``stop``; returns counts of what was done."""
    held: dict[int, list[socket.socket]] = {}
    counts = {"opened": 0, "dropped": 0}
    try:
        while not stop.is_set():
            for port in [p for p, kind in job_ports(launcher).items() if kind == "keeper"]:
                alive = []
                for sock in held.get(port, []):
                    try:
                        if sock.recv(4096, socket.MSG_DONTWAIT) == b"":
                            raise ConnectionResetError
                        alive.append(sock)  # the keeper's hello: the connection stays open
                    except BlockingIOError:
                        alive.append(sock)
                    except OSError:
                        sock.close()
                        counts["dropped"] += 1
                while len(alive) < per_port and not stop.is_set():
                    try:
                        alive.append(socket.create_connection(("127.0.0.1", port), timeout=0.5))
                        counts["opened"] += 1
                    except OSError:
                        break
                held[port] = alive
            stop.wait(0.1)
    except psutil.Error:  # the job ended
        pass
    finally:
        for sock in [s for socks in held.values() for s in socks]:
            sock.close()
    return counts


@pytest.mark.extended  # make test: test_relayed_rebuild's silent survivor, test_transport's handshake timeout
@pytest.mark.timeout(300)
def test_silent_connections_to_the_keepers_do_not_stop_a_rebuild_from_parity(start_job, tmp_path, gpt_baseline):
    """Whoever reaches the keepers' port without the secret holds a hundred silent connections open to each of
    them for the whole run (more than a keeper's connection limit), opening new ones as the keepers drop old ones.
    The keepers still reach each other: parity is encoded, and node 1, lost at step 30, is rebuilt from it."""
    args, out = gpt_args(tmp_path, "silent", "--step-time", "0.2")
    job = start_job("--nnodes", "2", "--nproc-per-node", "2", "--inject", "node-loss@node=1,step=30", *args)
    job.wait_for_event(lambda e: e["event"] == "first_heartbeat", 120)
    stop = threading.Event()
    counts: dict[str, int] = {}
    holder = threading.Thread(target=lambda: counts.update(hold_silent_connections(job.proc.pid, stop)))
    holder.start()
    try:
        assert job.wait(240) == 0, job.output
    finally:
        stop.set()
        holder.join()
    assert counts["opened"] > 200 and counts["dropped"] > 0, counts  # both keepers were flooded and dropped some
    assert out.read_text().strip() == gpt_baseline, job.output
    plan = restores(job)[1]
    assert plan["restored_from"] == "parity", (plan, job.output)
    # the flood is counted, not logged connection by connection (the log would grow without bound)
    rejected = [e for e in job.events() if e["event"] == "peer_rejected"]
    minutes = (rejected[-1]["time"] - rejected[0]["time"]) / REJECT_NOTICE + 1 if rejected else 0
    assert rejected and len(rejected) <= 3 * minutes * (REJECT_LOGGED + 1) < counts["dropped"], (len(rejected), counts)
    assert_job_left_nothing(job)


def plant(path: Path, kind: str, victim: Path) -> None:
    """What another user may leave at a name ftrun will use in the (world-writable) shm dir."""
    if kind == "symlink":
        path.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(path, 0o666)
    else:  # a file of another user, writable by everyone (a root test run plays that user)
        path.write_bytes(victim.read_bytes())
        path.chmod(0o666)
        os.chown(path, 65534, 65534)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["symlink", "fifo", "file of another user"])
def test_ftrun_never_writes_through_nor_loads_what_another_user_planted_in_the_shm_dir(tmp_path, kind):
    """A slot, parity or heartbeat file and the temporary file of the job secret, each with something planted at
    its name: each is refused (nothing written to the link's target, no wait on the FIFO, nothing read from the
    other user's file), and a secret is written to a file of its own."""
    if kind == "file of another user" and os.geteuid() != 0:
        pytest.skip("needs root to make a file of another user")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious " * 1000)
    victim.chmod(0o644)
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o1777)
    for name, make in (("slot", lambda p: SlotFile(str(p), 1 << 16)), ("slot-adopted", lambda p: SlotFile(str(p))),
                       ("heartbeat", lambda p: HeartbeatTable(str(p), 4))):
        path = shm / f"ftrun-job-node0-{name}"
        plant(path, kind, victim)
        with pytest.raises(PermissionError, match="not a file of ftrun's"):
            make(path)
    secret = shm / "ftrun-job-secret"
    plant(Path(f"{secret}.{os.getpid()}"), kind, victim)
    try:
        write_shm_file(str(secret), "s3cret")
    except UsageError as err:  # not root: another user's file cannot be removed from a sticky directory
        assert kind == "file of another user" and "cannot write" in str(err)
    else:
        info = os.lstat(secret)
        assert stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o600
        assert secret.read_text() == "s3cret"
    assert victim.read_bytes() == b"precious " * 1000 and stat.S_IMODE(victim.stat().st_mode) == 0o644


@pytest.mark.timeout(60)
def test_a_job_whose_file_names_hold_someone_elses_link_refuses_to_start_in_one_line(tmp_path):
    """Before it starts, a job looks at the names of its files in the shm dir: a symbolic link there (say, to a
    file of the user's, planted by another user who guessed the --rdzv-id) is one line and exit 2, and the
    link's target is left as it was."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o1777)
    job = f"t{uuid.uuid4().hex[:10]}"
    link = shm / f"ftrun-{job}-node0-rank0-slot1"
    link.symlink_to(victim)
    args, _ = gpt_args(tmp_path, "planted")
    result = subprocess.run([sys.executable, "-m", "ftrun", "--rdzv-id", job, "--nnodes", "2", *args],
                            capture_output=True, text=True, timeout=50, env={**os.environ, ENV_SHM_DIR: str(shm)})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"ftrun: error: {link} is a symbolic link, not a file of this user's ftrun (planted by someone else?): "
        "ftrun will not write through it nor load it; remove it, or choose another --rdzv-id"], result.stderr
    assert victim.read_text() == "precious" and sorted(os.listdir(shm)) == [link.name]


@pytest.mark.extended  # make test: the forged control values and hostile traffic
@pytest.mark.timeout(300)
def test_documents_deleted_from_the_control_store_are_written_again(start_job, tmp_path, gpt_baseline):
    """An intruder at the control store deletes the documents through which the nodes secure their snapshots
    (each node's ``commit`` and ``parity``, node 0's ``progress``) over and over until the trainers have taken
    their last snapshot, then stops. The job finishes with the failure-free state: the nodes write them again
    (before, the last snapshot waited forever for documents nobody wrote again)."""
    args, out = gpt_args(tmp_path, "deleted", "--step-time", "0.2")
    job = start_job("--nnodes", "2", "--nproc-per-node", "2", *args)
    job.wait_for_event(lambda e: e["event"] == "first_heartbeat", 120)
    endpoint = json.loads(Path(shm_dir(), f"ftrun-{job.job_id}-launcher").read_text())["endpoint"]
    host, port = endpoint.rsplit(":", 1)
    intruder = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    prefix = f"ftrun/{job.job_id}/1/gen/0/"
    keys = [prefix + "progress", *(f"{prefix}{what}/{node}" for what in ("commit", "parity") for node in (0, 1))]
    last = None
    while job.proc.poll() is None and (last is None or time.monotonic() < last + 2):
        for key in keys:
            intruder.delete_key(key)
        if last is None and "step 60 loss" in job.output:  # the trainers' last step: its snapshot is being secured
            last = time.monotonic()
        time.sleep(0.02)
    assert job.wait(60) == 0, job.output
    assert out.read_text().strip() == gpt_baseline, job.output
    assert not primary_failures(job), job.output
    assert_job_left_nothing(job)
