"""The trainer's launcher (``python -m kubetitan_trainer.launch ARGS``) with CUDA reported initialised in it (NVML
could not answer): it then starts the workers as new processes (spawn) instead of forking them. Run as
``python -m tests.trainer.launch_as_if_cuda ARGS`` by tests/trainer/test_units.py."""

import sys

from kubetitan_trainer.launch import launcher as launch

launch.cuda_initialised = lambda: True
launch.worker_main.exit_now(launch.main(sys.argv[1:]))
