"""Group-wise int8/int4 weights (llama.cpp's Q8_0 / Q4_0 / Q4_1 blocks among them), stored and
streamed as codes, multiplied without a dense copy.

  format.py  QuantSpec, quantize / dequantize, the GGUF blocks taken as they are
  matmul.py  quant_linear and the choice of its kernel (fast ones only where checked on this CPU)
  cpu.py     the few-row C loop (offload/csrc/quant_gemv.c) and its thread split
"""

from offload.quant.format import QuantError, QuantSpec, dequantize, from_gguf, packed_bytes, quantize
from offload.quant.matmul import check_kernels, kernels_run, quant_linear, workspace_bytes

__all__ = ["QuantError", "QuantSpec", "quantize", "dequantize", "packed_bytes", "from_gguf",
           "quant_linear", "check_kernels", "kernels_run", "workspace_bytes"]
