"""Sparsity patterns of Jacobians and Hessians, and the colorings that compress them.

>>> import numpy as np
>>> from diffiface import sparse
>>> pattern = sparse.jacobian_pattern(lambda x: x**2, np.ones(3), detector=sparse.KnownPattern(np.eye(3)))
>>> sparse.color_jacobian(pattern).count
1

Importing this module imports no array framework (scipy included): each is imported on first use.
"""

from ._coloring import ORDERS as ORDERS
from ._coloring import Coloring as Coloring
from ._coloring import color_hessian as color_hessian
from ._coloring import color_jacobian as color_jacobian
from ._detection import TRACERS as TRACERS
from ._detection import Detection as Detection
from ._detection import Detector as Detector
from ._detection import GlobalDetector as GlobalDetector
from ._detection import KnownPattern as KnownPattern
from ._detection import LocalDetector as LocalDetector
from ._detection import detect as detect
from ._detection import hessian_pattern as hessian_pattern
from ._detection import jacobian_pattern as jacobian_pattern

__all__ = [
    # detection
    "TRACERS",
    "Detection",
    "Detector",
    "GlobalDetector",
    "KnownPattern",
    "LocalDetector",
    "detect",
    "hessian_pattern",
    "jacobian_pattern",
    # coloring
    "ORDERS",
    "Coloring",
    "color_hessian",
    "color_jacobian",
]
