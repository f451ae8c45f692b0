import torch


class QuantizedTensor(torch.Tensor):
    """TE's base class of quantized tensors: megatron-core isinstance-checks parameters against it. The stand-in
    never creates one."""
