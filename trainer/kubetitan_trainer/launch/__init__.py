"""The pod's launcher: ``python -m kubetitan_trainer.launch`` (``launcher``: argument parsing, the static torchrun
path, the in-place agent, the rendezvous-store protocol between launchers, GPU-fault reports)."""
