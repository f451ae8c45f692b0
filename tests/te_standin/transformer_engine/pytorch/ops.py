"""TE's operation-fuser API, named only: megatron-core's TEFusedMLP / TEActivationOp annotate with these classes at
import time; the layer spec the project uses (use_te_op_fuser off) never builds them."""


class FusibleOperation:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("TE's operation fuser is not part of the stand-in (tests/te_standin)")


class Sequential(FusibleOperation):
    pass
