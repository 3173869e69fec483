"""A trainer that only beats (no collectives) for --seconds: node loss can then only be seen by beats."""

import argparse
import time

import ftrun

parser = argparse.ArgumentParser()
parser.add_argument("--seconds", type=float, default=5.0)
args = parser.parse_args()
end = time.monotonic() + args.seconds
step = 0
while time.monotonic() < end:
    step += 1
    ftrun.heartbeat(step)
    time.sleep(0.05)
