from callbacks.unused_parameters import UnusedParameterCheck

__all__ = ["UnusedParameterCheck"]
