"""FP8 is always off in the stand-in: the global state says so, and autocast can only be entered disabled."""
import contextlib


class FP8GlobalStateManager:
    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe():
        return None


def fp8_autocast(enabled: bool = True, **kwargs):
    if enabled:
        raise NotImplementedError("the Transformer Engine stand-in has no FP8 (tests/te_standin)")
    return contextlib.nullcontext()
