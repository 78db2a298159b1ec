"""``unet_darcy.py`` under torchrun, with one rank stopping itself (SIGSTOP) in a given step.

    python -m torch.distributed.run --nproc-per-node 3 tests/examples/_stall.py STEP RANK [unet_darcy flags]

Used by ``test_training_safety.py``: the rank prints ``stalling rank R at step S <time>`` and stops in
the forward of step S; the other ranks' watchdogs must report it and end the job.
"""

import os
import signal
import sys
import time

import _common
import torch.distributed as dist
import unet_darcy

STEP, RANK = int(sys.argv[1]), int(sys.argv[2])
_loss_fn, _calls = unet_darcy.loss_fn, [0]


def _stalling_loss_fn(model, batch):
    _calls[0] += 1
    if _calls[0] == STEP and dist.get_rank() == RANK:
        print(f"stalling rank {RANK} at step {STEP} {time.time()}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    return _loss_fn(model, batch)


unet_darcy.loss_fn = _stalling_loss_fn
if __name__ == "__main__":
    raise SystemExit(_common.main(unet_darcy.run, sys.argv[3:]))
