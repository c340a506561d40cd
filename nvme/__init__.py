"""nvme: move bytes between memory and files fast (the NVMe tier of offload).

IOEngine     async positional reads/writes of byte ranges, O_DIRECT where possible
SwapStore    a locked directory of checksummed, atomically replaced safetensors swap files
format       the safetensors layout (read any shard, write 4 KiB-aligned files)

Knows nothing about models or optimizers; nothing here imports `offload`.
"""

from nvme.format import (FormatError, SafetensorsFile, TensorInfo, read_header, tensor_bytes,
                         write_file)
from nvme.io import (ALIGN, IOEngine, IOEngineError, IOHandle, aligned_empty, crc32_combine)
from nvme.swap import ChecksumError, SwapEntry, SwapError, SwapStore

__all__ = [
    "ALIGN", "ChecksumError", "FormatError", "IOEngine", "IOEngineError", "IOHandle",
    "SafetensorsFile", "SwapEntry", "SwapError", "SwapStore", "TensorInfo", "aligned_empty",
    "crc32_combine", "read_header", "tensor_bytes", "write_file",
]
