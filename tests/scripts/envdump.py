"""Writes the torchrun-contract variables this trainer sees, and its whole environment (``_environ``), to
$ENVDUMP_DIR/<restart>-<rank>.json; beats;
with --crash-gen0 rank 1 exits 1 in generation 0 so the job restarts once."""

import json
import os
import sys
import time

NAMES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
         "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
         "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
         "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
         "OMP_NUM_THREADS")

env = {name: os.environ.get(name) for name in NAMES}
env["_all"] = sorted(k for k in os.environ if k in NAMES or k.startswith(("TORCHELASTIC_", "FTRUN_")))
env["_environ"] = dict(os.environ)
path = os.path.join(os.environ["ENVDUMP_DIR"], f"{env['TORCHELASTIC_RESTART_COUNT']}-{env['RANK']}.json")
with open(path, "w") as f:
    json.dump(env, f)
try:
    import ftrun

    ftrun.heartbeat(0)
except ImportError:
    pass
time.sleep(1.0)
if "--crash-gen0" in sys.argv and env["RANK"] == "1" and env["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(1)
