"""The optimizer: the fused CPU AdamW step and where its state lives between steps.

  adamw.py  the AdamW step on the CPU: a C kernel (offload/csrc/cpu_adamw.c, checked on this CPU
            in a child process first) or the chunked torch path
  state.py  optimizer state between steps: resident in RAM, or NVMe swap files pipelined
            read / step / write per block
"""

from offload.optim.adamw import BYTES_PER_PARAM_16BIT, active_implementation, cpu_adamw_step
from offload.optim.state import NvmeState, ResidentState

__all__ = ["cpu_adamw_step", "active_implementation", "BYTES_PER_PARAM_16BIT", "NvmeState",
           "ResidentState"]
