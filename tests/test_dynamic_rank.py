"""torchrun's documented multi-node form without --node-rank: the launchers agree their node ranks over the
control store (first come, first served), and one that finds every rank taken joins as a hot spare."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from conftest import SCRIPTS, assert_job_left_nothing, free_port
from ftrun.launch.config import build_config


def test_rdzv_endpoint_and_nnodes_without_node_rank_is_one_node_of_a_multi_node_job():
    endpoint = {"rdzv_endpoint": "127.0.0.1:29400", "rdzv_backend": "c10d"}
    dynamic = build_config(None, {"nnodes": 2, **endpoint})
    assert (dynamic.rank_by_store, dynamic.local_mode, dynamic.node_rank) == (True, False, None)
    assert build_config(None, {"nnodes": "1:4", **endpoint}).rank_by_store
    assert build_config(None, {"nnodes": 2, "rdzv_backend": "etcd", "rdzv_endpoint": "e1:2379,e2:2379"}).rank_by_store
    # all nodes simulated here, as before: one node, no endpoint, --standalone, --master-port only
    for local in ({"nnodes": 1, **endpoint}, {"nnodes": 2}, {"nnodes": 2, "standalone": True, **endpoint},
                  {"nnodes": 2, "master_port": 29555}):
        cfg = build_config(None, local)
        assert (cfg.rank_by_store, cfg.local_mode) == (False, True), local
    # --standalone: a local store on a free port, as torchrun, whatever the rendezvous flags say (an endpoint of
    # another host, or etcd's, was refused or used)
    for given in ({"rdzv_endpoint": "198.51.100.7:29500"}, {"rdzv_backend": "etcd", "rdzv_endpoint": "e1:2379"}):
        cfg = build_config(None, {"standalone": True, **given})
        assert (cfg.local_mode, cfg.rdzv_backend, cfg.rdzv_endpoint) == (True, "c10d", None), given
    for ranked in ({"nnodes": 2, "node_rank": 1, **endpoint}, {"standby": True, **endpoint}):
        assert not build_config(None, ranked).rank_by_store


@pytest.mark.timeout(60)
def test_launchers_without_node_rank_agree_ranks_and_a_late_one_joins_as_spare(start_job, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    release = tmp_path / "release"
    job_id = f"t{uuid.uuid4().hex[:10]}"
    common = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"127.0.0.1:{free_port()}", "--rdzv-timeout", "30", str(SCRIPTS / "world.py"), "--out", str(out),
              "--until", str(release))

    def launcher(name: str):  # one job; an output file and a log dir each (the first's id cleans the job up)
        if name == "a":
            return start_job(*common, job_id=job_id, log_dir=tmp_path / "logs-a")
        return start_job("--rdzv-id", job_id, *common, job_id=f"{job_id}-{name}", log_dir=tmp_path / f"logs-{name}")

    nodes = [launcher("a"), launcher("b")]
    agreed = [node.wait_for_event(lambda e: e["event"] == "node_rank", timeout=30) for node in nodes]
    assert sorted(e["node_rank"] for e in agreed) == [0, 1]
    assert all("agreed through the control store" in e["message"] for e in agreed)
    deadline = time.monotonic() + 30
    while not all((out / f"{rank}.json").exists() for rank in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.05)
    late = launcher("late")
    joined = late.wait_for_event(lambda e: e["event"] == "start", timeout=30)
    assert joined["all_ranks_taken"], joined
    assert "all 2 node ranks of run" in joined["message"] and "as a hot spare" in joined["message"], joined
    late.wait_for_event(lambda e: e["event"] == "spare_up", timeout=30)
    release.touch()  # the trainers end: the job is done, the spare leaves unused
    for job in (*nodes, late):
        assert job.wait(30) == 0, job.output
    seen = [json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert sorted(s["GROUP_RANK"] for s in seen) == ["0", "1"]
    assert all(s["WORLD_SIZE"] == "2" and s["world"] == 2 and s["sum"] == 3 for s in seen), seen
    assert not [e for e in late.events() if e["event"] == "node_rank"]
    assert_job_left_nothing(nodes[0])


@pytest.mark.extended  # make test: test_launchers_without_node_rank_agree_ranks (c10d), test_etcd_jobs
@pytest.mark.timeout(60)
def test_with_etcd_too_the_launchers_agree_their_node_ranks(start_job, tmp_path, etcd):
    out = tmp_path / "out"
    out.mkdir()
    job_id = f"t{uuid.uuid4().hex[:10]}"
    common = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints,
              "--rdzv-timeout", "30", str(SCRIPTS / "world.py"), "--out", str(out))
    nodes = [start_job(*common, job_id=job_id, log_dir=tmp_path / "logs-a"),
             start_job("--rdzv-id", job_id, *common, job_id=f"{job_id}-b", log_dir=tmp_path / "logs-b")]
    for node in nodes:
        assert node.wait(45) == 0, node.output
    assert sorted(e["node_rank"] for node in nodes for e in node.events() if e["event"] == "node_rank") == [0, 1]
    seen = [json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert all(s["WORLD_SIZE"] == "2" and s["sum"] == 3 for s in seen), seen
    assert_job_left_nothing(nodes[0])
