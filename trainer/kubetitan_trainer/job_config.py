"""The ``[kubetitan]`` table of ``trainer.toml``, merged into torchtitan's ``JobConfig``.

torchtitan 0.2.2 extends its config through ``job.custom_config_module``: the rendered TOML names this module,
whose ``JobConfig`` dataclass ConfigManager merges with its own (``torchtitan/config/manager.py``,
``_maybe_add_custom_config``). The table itself is defined once, in the shared contract
(:mod:`kubetitan_core.contract.trainer_toml`), which the operator's renderer writes with; this module only hands it
to torchtitan. Torch-free.
"""

from kubetitan_core.contract.trainer_toml import (JobConfig, Kubetitan, KubetitanCheckpointStorage, KubetitanData,
                                                  KubetitanDataS3, KubetitanModel, KubetitanTokenizer)

__all__ = ["JobConfig", "Kubetitan", "KubetitanCheckpointStorage", "KubetitanData", "KubetitanDataS3",
           "KubetitanModel", "KubetitanTokenizer"]
