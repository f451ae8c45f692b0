"""megatron-core's fusion decorator where nothing it compiles can run: the identity, not torch.compile.

megatron-core decorates its fusion functions (bias-SwiGLU, bias-GeLU, bias-dropout-add, ...) at import with
`megatron.core.jit.jit_fuser`, which is `torch.compile`. Decorating imports torch's compiler stack (dynamo and
inductor): 2.5 CPU-s of the 6.4 that `import megatron.core` costs on a 2-core CPU machine, in every process (each
trainer rank, rollout server and command-line tool; about 150 processes in the test suite). Where triton is not
installed (the CPU build of torch), the project turns on none of the fusions that go through it
(models/accelerator.py: `bias_activation_fusion` and `bias_dropout_fusion` need CUDA and triton), and the other
decorated functions belong to features it does not build on the CPU (GroupedMLP, the DeepEP dispatcher, expert bias,
the attention output gate): so there megatron-core gets its own `noop_decorator` behaviour instead, through the
module it imports the decorator from, before it is imported. Where triton is installed (every CUDA build of torch)
nothing changes.
"""
import importlib.util
import sys
import types


def skip_megatron_jit_without_triton() -> bool:
    """Give megatron-core an identity `jit_fuser` unless triton is installed or megatron-core is imported already
    (then it keeps what it has); whether it did."""
    if "megatron.core" in sys.modules or importlib.util.find_spec("triton") is not None:
        return False
    jit = types.ModuleType("megatron.core.jit", "megatron-core's fusion decorator on a machine without triton: "
                                                "the identity (megatron_gtpo/_megatron_jit.py)")
    jit.jit_fuser = _identity
    sys.modules["megatron.core.jit"] = jit
    return True


def _identity(func):
    return func
