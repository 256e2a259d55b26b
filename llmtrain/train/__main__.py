"""`deepspeed --num_gpus N --module llmtrain.train CONFIG --run-dir DIR [a.b=c ...]`."""

import logging
import os
import sys

from llmtrain.cli import main

if __name__ == "__main__":
    rc = main(["train", *sys.argv[1:]])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without running C++ static destructors: after gloo and DeepSpeed (ZeRO-3) threads,
    # they occasionally abort a finished rank ("terminate called without an active exception"),
    # which the launcher reports as a failed run. Everything the run writes is closed and
    # fsynced by now.
    os._exit(rc)
