"""offload: train and run models far larger than the device that runs them.

    import offload
    engine = offload.initialize(model, offload.OffloadConfig(offload="nvme", nvme_dir="/mnt/nvme"))
    engine.backward(loss_fn(model(batch)))
    engine.step()
"""

from offload.config import ConfigError, OffloadConfig, from_deepspeed, load_config_file
from offload.train.engine import Engine, StepReport, initialize
from offload.train.torch_optim import OffloadAdamW
from offload.memory.tiers import BudgetError

__all__ = ["OffloadConfig", "ConfigError", "BudgetError", "Engine", "StepReport", "initialize",
           "from_deepspeed", "load_config_file", "OffloadAdamW"]
