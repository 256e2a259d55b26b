"""`deepspeed --num_gpus N --module llmtrain.eval RUN [a.b=c ...] --tasks ...`: `llmtrain eval`
on every rank, the checkpoint loaded at the run's layout (`--sharded`, llmtrain.eval.sharded)."""

import logging
import os
import sys

from llmtrain.cli import main

if __name__ == "__main__":
    rc = main(["eval", "--sharded", *sys.argv[1:]])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # as llmtrain.train's entry: no C++ static destructors after gloo / DeepSpeed
