"""``python -m kubetitan_trainer.launch``: the pod entry point (:func:`kubetitan_trainer.launch.launcher.main`)."""

if __name__ == "__main__":
    from kubetitan_trainer import main as worker_main
    from kubetitan_trainer.launch.launcher import main

    worker_main.exit_now(main())
