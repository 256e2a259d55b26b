"""`deepspeed --num_gpus N --module llmtrain.train CONFIG --run-dir DIR [a.b=c ...]`."""

import sys

from llmtrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
