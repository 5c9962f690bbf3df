"""The tail as data: the format registry (formats.py), the spec of one call's tail (spec.py) and the
argument checks of every call (checks.py). Nothing here touches a GPU."""
from .formats import FORMATS, Format, Layout
from .spec import OutputSpec, Outputs, TailSpec

__all__ = ["FORMATS", "Format", "Layout", "TailSpec", "OutputSpec", "Outputs"]
