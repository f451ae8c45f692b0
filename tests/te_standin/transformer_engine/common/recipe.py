"""TE's FP8 recipe classes, as names: megatron-core subclasses DelayedScaling and isinstance-checks the others. The
stand-in never quantizes, so no recipe is ever applied."""
import enum


class Format(enum.Enum):
    E4M3 = "E4M3"
    HYBRID = "HYBRID"


class Recipe:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)


class DelayedScaling(Recipe):
    pass


class Float8CurrentScaling(Recipe):
    pass


class Float8BlockScaling(Recipe):
    pass


class MXFP8BlockScaling(Recipe):
    pass


class NVFP4BlockScaling(Recipe):
    pass
